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
from typing import Any

import torch

from kubellm.data.records import DataError


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
