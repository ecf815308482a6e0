"""The distributed, deterministic, resumable loader over prepare_data's packed Parquet shards.

Order is a pure function of (seed, epoch, position): every epoch is a seeded permutation of
all sequences; step k takes the k-th global batch of it, and each rank takes its contiguous
slice of that batch (then its micro-batches). So:

- every rank computes the same global order without talking to the others;
- the position is two integers, saved in the checkpoint; resuming restores it exactly;
- a different WORLD_SIZE on resume (DCP reshards the model) still sees the same global
  batches, split differently.

Shards are read once into int32 ids and labels (8 bytes per token per rank); beyond
memory-sized datasets this is the place to switch to memory-mapped shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from kubellm.data.prepare import DataError

IGNORE_INDEX = -100


def load_split(dataset_dir: str | Path, split: str) -> torch.Tensor:
    """Rows of a split as int32, shape (2, N, seq_len): input ids and labels (-100 masked)."""
    files = sorted((Path(dataset_dir) / split).glob("*.parquet"))
    if not files:
        raise DataError(f"{dataset_dir}/{split} has no Parquet shards")
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    seq_len = 0
    for f in files:
        table = pq.read_table(f)
        col = table.column("input_ids").combine_chunks()
        if len(col) == 0:
            continue
        flat = np.asarray(col.flatten(), dtype=np.int32)
        seq_len = seq_len or len(flat) // len(col)
        if len(flat) != seq_len * len(col):
            raise DataError(f"{f}: rows are not all {seq_len} tokens long (not a packed shard)")
        ids_parts.append(flat.reshape(len(col), seq_len))
        if "loss_mask" in table.column_names:
            m = np.asarray(table.column("loss_mask").combine_chunks().flatten(), dtype=np.bool_)
            mask_parts.append(m.reshape(len(col), seq_len))
        else:
            mask_parts.append(np.ones((len(col), seq_len), dtype=np.bool_))
    if not ids_parts:
        raise DataError(f"{dataset_dir}/{split} has no rows")
    ids = torch.from_numpy(np.concatenate(ids_parts))
    keep = torch.from_numpy(np.concatenate(mask_parts))
    return torch.stack([ids, ids.masked_fill(~keep, IGNORE_INDEX)])


def batch_indices(n: int, step: int, batch: int, seed: int) -> torch.Tensor:
    """Rows of the global batch at `step`: epochs are seeded permutations, so order is exact."""
    per_epoch = n // batch
    if per_epoch == 0:
        raise DataError(f"dataset has {n} sequences, fewer than one batch of {batch}")
    epoch, pos = divmod(step, per_epoch)
    return _permutation(n, seed, epoch)[pos * batch : (pos + 1) * batch]


@lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """One epoch's order, made once (not once per step: n can be millions)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


@dataclass
class LoaderState:
    """What a checkpoint stores of the loader: where it is, and what it was reading."""

    step: int
    num_sequences: int
    global_batch: int
    seed: int


class DistributedLoader:
    """This rank's micro-batches of each global batch, in an order fixed by the seed."""

    def __init__(
        self,
        data: torch.Tensor,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        per_rank = global_batch // world_size
        if per_rank * world_size != global_batch or per_rank % micro_batch:
            raise ValueError(
                f"global batch {global_batch} does not split into {world_size} ranks x "
                f"micro-batches of {micro_batch}"
            )
        self.data = data
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.rank = rank
        self.per_rank = per_rank
        self.seed = seed
        self.step = 0
        batch_indices(self.num_sequences, 0, global_batch, seed)  # fails early if too small

    @property
    def num_sequences(self) -> int:
        return int(self.data.shape[1])

    @property
    def seq_len(self) -> int:
        return int(self.data.shape[2])

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, labels) micro-batches of this rank for the current step; advances."""
        idx = batch_indices(self.num_sequences, self.step, self.global_batch, self.seed)
        mine = idx[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        rows = self.data[:, mine].long()
        self.step += 1
        return [
            (rows[0, i : i + self.micro_batch], rows[1, i : i + self.micro_batch])
            for i in range(0, self.per_rank, self.micro_batch)
        ]

    def state_dict(self) -> dict[str, Any]:
        return LoaderState(
            self.step, self.num_sequences, self.global_batch, self.seed
        ).__dict__.copy()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = LoaderState(**state)
        if (saved.num_sequences, saved.global_batch, saved.seed) != (
            self.num_sequences,
            self.global_batch,
            self.seed,
        ):
            raise DataError(
                "the checkpoint's data position does not fit this run: it was taken with "
                f"{saved.num_sequences} sequences, global batch {saved.global_batch}, seed "
                f"{saved.seed}; this run has {self.num_sequences}, {self.global_batch}, "
                f"{self.seed} (a different dataset or config: use a new checkpoint_dir)"
            )
        self.step = saved.step
