"""Training checkpoints with torch.distributed.checkpoint (DCP), committed atomically.

Layout under the checkpoint directory:

    step-00000100/          a complete checkpoint: DCP shards + .metadata, trainer.pt, COMPLETE
    step-00000200.tmp/      being written (or a writer that died): never loaded

Every rank writes its DCP shards (model and optimizer, sharded as they are in memory, so
FSDP and DDP checkpoints load on any world size) into the `.tmp` folder; after a barrier
rank 0 writes the trainer state (step, scheduler, loader position, RNG) and the COMPLETE
marker, then renames the folder. A
checkpoint is only ever read from a committed folder, and one that fails to load (a shard
deleted, a truncated file) is skipped with a warning in favour of the next newest.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

MARKER = "COMPLETE"
TRAINER_STATE = "trainer.pt"
_NAME = re.compile(r"^step-(\d{8})$")


@dataclass
class Resumed:
    path: Path
    trainer: dict[str, Any]  # what `save` was given as trainer_state


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Committed checkpoints, newest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [
        p for p in base.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / MARKER).is_file()
    ]
    return sorted(found, key=lambda p: p.name, reverse=True)


def save(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    rank: int,
    keep: int,
) -> Path:
    """Write checkpoint `step` (collective: every rank calls it) and keep the newest `keep`."""
    base = Path(root)
    final = base / f"step-{step:08d}"
    tmp = base / f"step-{step:08d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    if rank == 0:
        torch.save({"step": step, **trainer_state}, tmp / TRAINER_STATE)
        (tmp / MARKER).write_text(f"{step}\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(base)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_latest(
    root: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Resumed | None:
    """Restore model and optimizer from the newest checkpoint that loads (collective).

    Returns the trainer state saved with it (the caller restores scheduler, loader, RNG), or
    None when there is no checkpoint.
    """
    for path in complete_checkpoints(root):
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
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
