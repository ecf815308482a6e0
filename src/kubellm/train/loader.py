"""The distributed, deterministic, resumable loader over prepare_data's packed Parquet shards.

Order is a pure function of (seed, epoch, position): every epoch is a seeded permutation of
all sequences; step k takes the k-th global batch of it, and each rank takes its contiguous
slice of that batch (then its micro-batches). So:

- every rank computes the same global order without talking to the others;
- the position is two integers, saved in the checkpoint; resuming restores it exactly;
- a different WORLD_SIZE on resume (DCP reshards the model) still sees the same global
  batches, split differently.

Rows come from a row source: the split's shards memory-mapped from the node's cache
(kubellm.train.shards.ShardRows), so a rank holds only the rows of the step it is on and
the next one, whatever the corpus size (a (2, N, seq_len) tensor also works: tests). Each
step's rows of this rank are gathered once as int32; on CUDA into pinned memory, copied to
the device in one non-blocking transfer, widened to int64 and split into micro-batches there.
While the caller computes step k, a background thread gathers step k+1.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
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


def _on_thread(device: torch.device | None) -> None:
    """The prefetch thread's start: pinned memory is allocated there, so it works on this
    rank's GPU (else its CUDA context would be a new one on GPU 0)."""
    if device is not None:
        torch.cuda.set_device(device)


@dataclass
class LoaderState:
    """What a checkpoint stores of the loader: where it is, and what it was reading."""

    step: int
    num_sequences: int
    global_batch: int
    seed: int


class RowSource(Protocol):
    """What the loader reads: kubellm.train.shards.ShardRows, or TensorRows."""

    @property
    def num_sequences(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    def rows(
        self, indices: torch.Tensor | np.ndarray | Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class TensorRows:
    """A (2, N, seq_len) tensor of [ids, labels] as a row source (held in memory)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    @property
    def num_sequences(self) -> int:
        return int(self.data.shape[1])

    @property
    def seq_len(self) -> int:
        return int(self.data.shape[2])

    def rows(
        self, indices: torch.Tensor | np.ndarray | Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        picked = self.data[:, torch.as_tensor(indices, dtype=torch.long)]
        return picked if out is None else out.copy_(picked)


class DistributedLoader:
    """This rank's micro-batches of each global batch, in an order fixed by the seed."""

    def __init__(
        self,
        data: RowSource | torch.Tensor,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device | str = "cpu",
        prefetch: bool | None = None,
    ) -> None:
        per_rank = global_batch // world_size
        if per_rank * world_size != global_batch or per_rank % micro_batch:
            raise ValueError(
                f"global batch {global_batch} does not split into {world_size} ranks x "
                f"micro-batches of {micro_batch}"
            )
        self.source: RowSource = TensorRows(data) if isinstance(data, torch.Tensor) else data
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.rank = rank
        self.per_rank = per_rank
        self.seed = seed
        self.step = 0
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # The next step's rows are gathered in a background thread while an accelerator
        # computes; on CPU that thread only competes with the step for the GIL and the
        # cores (measured: ~7 % fewer tokens/s on the 2-core CPU benchmark), so by default
        # it runs on accelerators only.
        self.prefetch = self.device.type != "cpu" if prefetch is None else prefetch
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future[torch.Tensor]] | None = None  # (step, its rows)
        batch_indices(self.num_sequences, 0, global_batch, seed)  # fails early if too small

    @property
    def num_sequences(self) -> int:
        return self.source.num_sequences

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, labels) micro-batches of this rank for the current step, int64 on the
        device; advances, and starts gathering the next step's rows."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self.step:
            rows = ahead[1].result()
        else:
            rows = self._gather(self.step)
        self.step += 1
        if self.prefetch:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix="kubellm-loader",
                    initializer=_on_thread,  # not a method: the thread would keep self alive
                    initargs=(self.device if self._pinned else None,),
                )
            self._ahead = (self.step, self._pool.submit(self._gather, self.step))
        if self.device.type != "cpu":
            rows = rows.to(self.device, non_blocking=True)
        rows = rows.long()
        return [
            (rows[0, i : i + self.micro_batch], rows[1, i : i + self.micro_batch])
            for i in range(0, self.per_rank, self.micro_batch)
        ]

    @property
    def _pinned(self) -> bool:
        return self.device.type == "cuda"

    def _gather(self, step: int) -> torch.Tensor:
        """This rank's rows of the step's global batch, int32 (2, per_rank, seq_len)."""
        idx = batch_indices(self.num_sequences, step, self.global_batch, self.seed)
        mine = idx[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        if not self._pinned:
            return self.source.rows(mine)
        out = torch.empty((2, self.per_rank, self.seq_len), dtype=torch.int32, pin_memory=True)
        return self.source.rows(mine, out=out)

    def close(self) -> None:
        """Stop the prefetch thread (a later next_batch starts it again)."""
        self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

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
        self._ahead = None  # gathered for the old position
        self.step = saved.step
