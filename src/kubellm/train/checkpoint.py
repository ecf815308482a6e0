"""Training checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout under the checkpoint directory:

    step-00000100/            a complete checkpoint: DCP shards + .metadata, trainer.pt, COMPLETE
    step-00000200.tmp/        being written (or a writer that died): never loaded
    step-00000050.<id>.deleting/   an old checkpoint being removed in the background: never loaded

Every rank writes its DCP shards (model and optimizer, sharded as they are in memory, so
FSDP and DDP checkpoints load on any world size) into the `.tmp` folder; once every rank's
write finished, rank 0 writes the trainer state (step, scheduler, loader position, RNG) and the
COMPLETE marker, then renames the folder. A checkpoint is only ever read from a committed
folder, and one that fails to load (a shard deleted, a truncated file) is skipped with a
warning in favour of the next newest.

A replicated state (DDP: every rank holds the same full tensors) is split before DCP sees it:
each rank hands over only its share (`replicated_share`: whole parameters with their optimizer
state, balanced by size), so each rank stages and writes 1/WORLD_SIZE of the state. Handed the
whole state, every rank would stage all of it (about 12 bytes per parameter: fp32 weights and
AdamW's two moments, pinned on GPUs) before DCP dropped the duplicates. Every rank still loads
the whole state on resume. A sharded state (FSDP2, HSDP: DTensors) is handed over as it is:
each rank's part is its own shard.

`Checkpointer` keeps the GPUs training while a checkpoint is written: `save` copies the state
to host memory (the only part the training waits for) and hands the write to a background
thread (`dcp.async_save`, on a gloo process group of its own, so its collectives never mix
with the training's); `wait` (or the next `save`, or `close`) commits it. Checkpoints beyond
`keep` are renamed out of the way at once and deleted by a background thread. With
`skip_frozen` (LoRA) the frozen base weights are neither written nor read: they come from the
pretrained model loaded at start-up.
"""

from __future__ import annotations

import copy
import heapq
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

MARKER = "COMPLETE"
TRAINER_STATE = "trainer.pt"
DELETING = ".deleting"
_NAME = re.compile(r"^step-(\d{8})$")
_TMP = re.compile(r"^step-\d{8}\.tmp$")


@dataclass
class Resumed:
    path: Path
    trainer: dict[str, Any]  # what `save` was given as trainer_state


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, Mapping):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _leaves(obj) if isinstance(t, torch.Tensor))


def is_replicated(state: dict[str, Any]) -> bool:
    """True when no tensor of `state` is sharded (no DTensor): under DDP every rank holds
    the same full tensors, which DCP would write once anyway (it treats equal keys of plain
    tensors on several ranks as copies)."""
    from torch.distributed.tensor import DTensor

    return not any(isinstance(t, DTensor) for t in _leaves(state))


def replicated_share(state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Rank `rank`'s share of a replicated {"model": ..., "optim": ...} state (what
    `get_state_dict` returns for a DDP model): whole parameters, each with its optimizer
    state, dealt out by size (largest first, to the least loaded rank) so that every rank
    computes the same split on its own; rank 0 also takes the optimizer's param_groups. The
    shares together are the state, each key once, so DCP writes the same checkpoint (the
    same keys, loadable on any world size) while each rank stages only its share."""
    model: dict[str, Any] = state["model"]
    optim: dict[str, Any] = state["optim"]
    per_param: dict[str, Any] = optim.get("state", {})
    sizes = {k: _nbytes(model.get(k)) + _nbytes(per_param.get(k)) for k in {*model, *per_param}}
    loads = [(0, r) for r in range(world)]  # a heap: the least loaded rank, then the lowest
    mine: set[str] = set()
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + sizes[key], owner))
        if owner == rank:
            mine.add(key)
    share: dict[str, Any] = {"state": {k: v for k, v in per_param.items() if k in mine}}
    if rank == 0:
        share.update({k: v for k, v in optim.items() if k != "state"})
    return {"model": {k: v for k, v in model.items() if k in mine}, "optim": share}


def _to_write(state: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """What this rank hands DCP: its share of a replicated state, else the state."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not is_replicated(state):
        return state
    return replicated_share(state, dist.get_rank(group), dist.get_world_size(group))


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Committed checkpoints, newest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [
        p for p in base.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / MARKER).is_file()
    ]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _paths(root: Path, step: int) -> tuple[Path, Path]:
    """(the `.tmp` folder a checkpoint is written to, the folder it is committed as)."""
    return root / f"step-{step:08d}.tmp", root / f"step-{step:08d}"


def _set_aside(path: Path) -> Path:
    """Rename `path` to a `.deleting` name (never listed nor loaded); returns the new path."""
    target = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{DELETING}")
    path.rename(target)
    return target


def _prepare(tmp: Path) -> list[Path]:
    """Rank 0: an empty `tmp`; returns what was set aside for deletion (a stale `tmp`)."""
    doomed = [_set_aside(tmp)] if tmp.exists() else []
    tmp.mkdir(parents=True)
    return doomed


def _commit(
    root: Path, step: int, tmp: Path, final: Path, trainer: dict[str, Any], keep: int
) -> list[Path]:
    """Rank 0, once every rank's shards are written: trainer state, marker, rename; then the
    checkpoints beyond `keep` are set aside. Returns the folders to delete."""
    torch.save({"step": step, **trainer}, tmp / TRAINER_STATE)
    (tmp / MARKER).write_text(f"{step}\n")
    doomed = [_set_aside(final)] if final.exists() else []  # the same step written again
    tmp.rename(final)
    doomed += [_set_aside(old) for old in complete_checkpoints(root)[keep:]]
    return doomed


def _leftovers(root: Path) -> list[Path]:
    """Rank 0 at start-up: uncommitted `.tmp` folders (set aside) and unfinished deletions."""
    if not root.is_dir():
        return []
    found: list[Path] = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and _TMP.match(p.name):
            found.append(_set_aside(p))
        elif p.name.startswith("step-") and p.name.endswith(DELETING):
            found.append(p)
    return found


def _remove(paths: list[Path], previous: threading.Thread | None) -> None:
    if previous is not None:
        previous.join()  # one deletion at a time, in order
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def save(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    rank: int,
    keep: int,
) -> Path:
    """Write checkpoint `step` synchronously (collective: every rank calls it) and keep the
    newest `keep`. `Checkpointer` does the same without holding up the training."""
    base = Path(root)
    tmp, final = _paths(base, step)
    doomed: list[Path] = []
    if rank == 0:
        doomed += _prepare(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save(_to_write({"model": model_sd, "optim": optim_sd}, None), checkpoint_id=str(tmp))
    _barrier()
    if rank == 0:
        doomed += _commit(base, step, tmp, final, trainer_state, keep)
        _remove(doomed, None)
    _barrier()
    return final


def load_latest(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    skip_frozen: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> Resumed | None:
    """Restore model and optimizer from the newest checkpoint that loads (collective).

    Returns the trainer state saved with it (the caller restores scheduler, loader, RNG), or
    None when there is no checkpoint. With `skip_frozen` the parameters with
    requires_grad=False are neither read nor required: they keep their current values.
    """
    options = StateDictOptions(ignore_frozen_params=skip_frozen)
    # without the frozen keys, load_state_dict(strict=True) would call them missing
    set_options = StateDictOptions(ignore_frozen_params=skip_frozen, strict=not skip_frozen)
    for path in complete_checkpoints(root):
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(path), process_group=process_group)
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=set_options,
            )
            trainer = torch.load(path / TRAINER_STATE, weights_only=True)
        # DCP reports every rank's failure as one CheckpointException (a BaseException)
        except (Exception, CheckpointException) as err:
            print(
                f"warning: checkpoint {path} cannot be loaded ({type(err).__name__}: {err}); "
                "trying the previous one",
                file=sys.stderr,
                flush=True,
            )
            continue
        return Resumed(path, trainer)
    return None


@dataclass
class _Pending:
    """A checkpoint whose shards are being written (or were written) but not yet committed."""

    step: int
    tmp: Path
    final: Path
    trainer: dict[str, Any]  # deep-copied at save time
    future: Future[Any] | None  # None: written synchronously
    committed: bool = False  # rank 0 committed it early (`poll`)


class Checkpointer:
    """Asynchronous, atomically committed DCP checkpoints under `root`, the newest `keep` kept.

    Construct it at the same point on every rank (it creates a process group) after the
    default process group, if any, is initialised. Every method but `poll` is collective.
    At most one checkpoint is in flight: `save` first finishes the previous one.
    """

    def __init__(
        self,
        root: str | Path,
        rank: int,
        keep: int,
        *,
        skip_frozen: bool = False,
        asynchronous: bool = True,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.rank = rank
        self.keep = keep
        self.skip_frozen = skip_frozen
        self.asynchronous = asynchronous
        # The background writer's collectives run on a gloo group of their own: a CPU backend
        # is what async_save requires, and the training's collectives (NCCL) never interleave
        # with them. Collective: every rank creates it here, in the same order.
        self._group: dist.ProcessGroup | None = (
            dist.new_group(backend="gloo") if dist.is_initialized() else None
        )
        self._stager: DefaultStager | None = None
        self._pending: _Pending | None = None
        self._deleter: threading.Thread | None = None
        if rank == 0:
            self._delete_later(_leftovers(self.root))

    @property
    def pending(self) -> Path | None:
        """The folder the checkpoint in flight will be committed as (None when none is)."""
        return self._pending.final if self._pending is not None else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
    ) -> Path:
        """Start writing checkpoint `step`; returns the folder `wait` will commit it as.

        Returns once the state is copied to host memory (the training may then change the
        parameters); the shards are written in the background unless `asynchronous` is off or
        there is no process group, in which case they are written before it returns. The
        checkpoint is committed by `wait`, the next `save`, or `close`.
        """
        self.wait()
        tmp, final = _paths(self.root, step)
        if self.rank == 0:
            self._delete_later(_prepare(tmp))
        _barrier(self._group)  # the folder exists before any rank writes into it
        trainer = copy.deepcopy(trainer_state)  # the training goes on changing the original
        model_sd, optim_sd = get_state_dict(
            model, optimizer, options=StateDictOptions(ignore_frozen_params=self.skip_frozen)
        )
        # under DDP: this rank's share only (`replicated_share`), staged and written by it
        state = _to_write({"model": model_sd, "optim": optim_sd}, self._group)
        future: Future[Any] | None = None
        if self.asynchronous and self._group is not None:
            # The stager copies every tensor (synchronously) before async_save returns, so
            # later optimizer steps cannot change what is written.
            response = dcp.async_save(
                state,
                checkpoint_id=str(tmp),
                process_group=self._group,
                async_stager=self._staging(),
            )
            future = (
                response.upload_completion if isinstance(response, AsyncSaveResponse) else response
            )
        else:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self._group)
        self._pending = _Pending(step, tmp, final, trainer, future)
        return final

    def poll(self) -> Path | None:
        """Not collective, cheap: commit the checkpoint in flight if its write has finished.

        Only rank 0 commits (DCP's write ends with a gather to rank 0, so rank 0's write being
        done means every rank's shards and the metadata are on disk); on other ranks, and
        while the write goes on, it does nothing. Returns the path it committed, or None.
        Calling it every step makes a finished checkpoint durable without waiting for the next
        `save`; `wait` still has to be called (the next `save` and `close` do).
        """
        pending = self._pending
        if self.rank != 0 or pending is None or pending.committed:
            return None
        future = pending.future
        if future is not None and (not future.done() or future.exception() is not None):
            return None  # still writing; a failed write is raised by `wait`, on every rank
        self._commit(pending)
        return pending.final

    def wait(self) -> Path | None:
        """Finish the checkpoint in flight and commit it (collective).

        Returns the committed folder, or None when no checkpoint was in flight. A failed write
        raises (DCP raises it on every rank) and leaves only the uncommitted `.tmp` folder.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.future is not None:
            pending.future.result()
        _barrier(self._group)
        if self.rank == 0 and not pending.committed:
            self._commit(pending)
        _barrier(self._group)  # committed for every rank when this returns
        return pending.final

    def close(self) -> Path | None:
        """`wait`, then let the background deletions finish (collective); returns what `wait`
        committed. The Checkpointer can still be used afterwards."""
        try:
            return self.wait()
        finally:
            if self._deleter is not None:
                self._deleter.join()
                self._deleter = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def load_latest(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> Resumed | None:
        """`load_latest` of this root, honouring `skip_frozen` (collective)."""
        if self._pending is not None:
            raise RuntimeError("load_latest while a checkpoint is being written; wait() first")
        return load_latest(
            self.root,
            model,
            optimizer,
            skip_frozen=self.skip_frozen,
            process_group=self._group,
        )

    def _commit(self, pending: _Pending) -> None:
        doomed = _commit(
            self.root, pending.step, pending.tmp, pending.final, pending.trainer, self.keep
        )
        pending.committed = True
        self._delete_later(doomed)

    def _delete_later(self, paths: list[Path]) -> None:
        """rmtree `paths` (already renamed out of the way) in a background thread."""
        if not paths:
            return
        # not a daemon: the interpreter lets it finish; if the process is killed, the next
        # Checkpointer finds the `.deleting` folders and deletes them
        thread = threading.Thread(
            target=_remove, args=(paths, self._deleter), name="checkpoint-delete"
        )
        thread.start()
        self._deleter = thread

    def _staging(self) -> DefaultStager:
        """One stager for the run: it keeps its host copies between checkpoints (pinned on
        CUDA), so a checkpoint after the first allocates nothing. Reusing them is safe because
        a checkpoint is staged only after the previous one was written."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager
