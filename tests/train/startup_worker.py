"""Workers of the start-up and sharded-accumulation tests (2 gloo ranks, spawned)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from kubellm.config import TrainConfig
from kubellm.train import startup
from kubellm.train.loop import _Run, check
from kubellm.train.model import build_model


def _start(rank: int, world: int, store: str, cfg_json: str) -> _Run:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = TrainConfig.model_validate_json(cfg_json)
    plan = check(cfg, world, rank)
    model = build_model(cfg, plan.tokenizer)
    return _Run(cfg, plan, model, rank, world)


def sharded_start(rank: int, world: int, store: str, cfg_json: str, out: str) -> None:
    """FSDP2 start-up of a pretrained model: what each rank read and holds, and the values."""
    reads: list[str] = []
    original = startup._read

    def counting(f: Any, entry: Any) -> torch.Tensor:
        reads.append(entry.name)
        return original(f, entry)

    startup._read = counting  # type: ignore[assignment]
    startup.CHUNK_BYTES = 4096  # many chunks: the streaming, not one broadcast
    try:
        run = _start(rank, world, store, cfg_json)
        local = sum(p.to_local().numel() for p in run.model.parameters())
        total = sum(p.numel() for p in run.model.parameters())
        meta_left = [n for n, p in run.model.named_parameters() if p.to_local().is_meta]
        full = get_model_state_dict(
            run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        report = {
            "rank": rank,
            "reads": len(reads),
            "local": local,
            "total": total,
            "meta_left": meta_left,
            "dtensor": all(isinstance(p, DTensor) for p in run.model.parameters()),
            "fused": all(g.get("fused") for g in run.opt.param_groups),
        }
        if rank == 0:
            torch.save(full, Path(out) / "full.pt")
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        startup._read = original  # type: ignore[assignment]
        dist.destroy_process_group()


def accumulation(rank: int, world: int, store: str, cfg_json: str, out: str) -> None:
    """After a non-final micro-batch under FSDP2, what gradient memory each rank holds."""
    try:
        run = _start(rank, world, store, cfg_json)
        micro = run.loader.next_batch()
        assert len(micro) == 2
        run.micro_step(*micro[0], parts=2, last=False)
        held_sharded = 0
        held_full = 0
        for p in run.model.parameters():
            if p.grad is not None:
                held_sharded += p.grad.to_local().numel()
        for module in run.model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state else None
            for fp in group.fsdp_params if group else []:
                acc = getattr(fp, "unsharded_accumulated_grad", None)
                if acc is not None:
                    held_full += acc.numel()
        total = sum(p.numel() for p in run.model.parameters())
        (Path(out) / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "sharded": held_sharded,
                    "full": held_full,
                    "total": total,
                    "shard_max": math.ceil(total / world) + 64 * world,
                }
            )
        )
    finally:
        dist.destroy_process_group()
