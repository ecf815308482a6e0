"""What the training-throughput peers share: config, data, schedule, device and the clock.

The peers (`hf_trainer`, `ddp_loop`) are run by `bench.train_bench` under torchrun, on the
same TrainConfig JSON that `python -m kubellm.train --config` gets, so the three contenders
cannot drift apart on model shape, batch, steps or optimizer settings. They share the
engine's pure pieces, which by definition must be the same (the rows from the Parquet
shards, read before the clock starts; the lr schedule; the FLOPs formula), and never its
training step: each peer's step is its own, and that is what is measured.

Each peer prints, on rank 0, `bench_step=K` marks (at the end of the warmup skip and of
the last step; the parent timestamps them as a cross-check) and one result line:
`bench_tokens_per_sec=... bench_loss=... bench_params=... bench_threads=...` (on GPUs also
`bench_peak_mem_gb=`: rank 0's torch.cuda.max_memory_allocated in GiB, the unit of the
engine's `peak_mem_gb`), and, after
the timed steps, one `bench_setup {json}` line (`describe`): the optimizer it actually built
(class, fused / foreach, lr, betas, eps, weight decay), the model (class, parameters, a hash
of the initial weights), batch per process, precision and torch threads, so the report
shows what each contender ran rather than what it was asked to run. `engine_probe` prints
the same line for kubellm.train itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kubellm.config import TrainConfig
from kubellm.data.artifact import load_split
from kubellm.train.mfu import model_flops_per_token


def parse_args(description: str) -> argparse.Namespace:
    """`--config FILE` (the TrainConfig JSON kubellm.train reads) and `--skip N`."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", required=True, help="TrainConfig JSON (kubellm.train's)")
    ap.add_argument("--skip", type=int, required=True, help="warmup steps left out of the rate")
    return ap.parse_args()


def read_config(path: str) -> dict[str, Any]:
    """The JSON validated as a TrainConfig, as a dict with every default filled in."""
    return TrainConfig.model_validate_json(Path(path).read_text()).model_dump()


def load_rows(dataset_dir: str) -> torch.Tensor:
    """The train split as (2, N, seq_len) int64 input ids and labels, made once up front."""
    return load_split(dataset_dir, "train").long()


def pick_device(backend: str) -> tuple[torch.device, str]:
    """(device, process-group backend) the way the engine picks them: nccl on GPUs, else gloo."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device, backend
    return torch.device("cpu"), backend


class StepClock:
    """Rank 0's steady-state clock: the wall time from the end of step `skip` to the last.

    Timestamps are taken only at those two step ends (with a device sync on GPUs), so the
    clock adds no per-step synchronisation the engine does not have.
    """

    def __init__(self, skip: int, steps: int, tokens_per_step: int, device: torch.device):
        if not 0 < skip < steps:
            raise SystemExit(f"--skip must be in (0, steps={steps}), got {skip}")
        self.skip, self.steps, self.tokens_per_step = skip, steps, tokens_per_step
        self.device = device
        self.rank = int(os.environ.get("RANK", "0"))
        self.t_skip = self.t_end = math.nan

    def step_end(self, done: int) -> None:
        """Call after optimizer step number `done` (1-based) has finished."""
        if self.rank != 0 or done not in (self.skip, self.steps):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if done == self.skip:
            self.t_skip = now
        else:
            self.t_end = now
        print(f"bench_step={done}", flush=True)

    def tokens_per_sec(self) -> float:
        return (self.steps - self.skip) * self.tokens_per_step / (self.t_end - self.t_skip)

    def report(self, loss: float, model: torch.nn.Module, seq_len: int) -> None:
        """The result line (rank 0): `name=value` pairs, as `parse_metrics` reads them."""
        if self.rank != 0:
            return
        params = sum(p.numel() for p in model.parameters())
        peak = peak_memory_gib(self.device)
        memory = f" bench_peak_mem_gb={peak:.6g}" if peak is not None else ""
        print(
            f"bench_tokens_per_sec={self.tokens_per_sec():.6g} bench_loss={loss:.6g} "
            f"bench_params={params} "
            f"bench_flops_per_token={model_flops_per_token(model, seq_len):.6g} "
            f"bench_threads={torch.get_num_threads()}{memory}",
            flush=True,
        )
        print(f"bench: device {self.device}", flush=True)


def peak_memory_gib(device: torch.device) -> float | None:
    """This rank's torch.cuda.max_memory_allocated so far, GiB (2**30 bytes, the unit of the
    engine's `peak_mem_gb` metric); None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


SETUP_PREFIX = "bench_setup "


def weights_hash(params: Iterable[torch.Tensor]) -> str:
    """sha256 (first 16 hex digits) of the parameters' float32 bytes, in order: same initial
    weights in two contenders give the same hash."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_settings(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What an optimizer was built with (its `defaults`, the per-group weight decays), and
    which AdamW implementation torch runs for it: `fused` or `foreach` when asked; with
    neither, torch picks foreach on CUDA and the single-tensor for-loop on CPU."""
    d = opt.defaults
    if d.get("fused"):
        impl = "fused"
    elif d.get("foreach"):
        impl = "foreach"
    elif d.get("foreach") is None:
        on_cuda = all(p.is_cuda for g in opt.param_groups for p in g["params"])
        impl = "foreach (default on CUDA)" if on_cuda else "for-loop (default on CPU)"
    else:
        impl = "for-loop"
    return {
        "optimizer": f"{type(opt).__module__}.{type(opt).__qualname__}",
        "implementation": impl,
        "fused": d.get("fused"),
        "foreach": d.get("foreach"),
        "lr": d.get("lr"),
        "betas": list(d["betas"]) if "betas" in d else None,
        "eps": d.get("eps"),
        "weight_decay": sorted({float(g.get("weight_decay", 0.0)) for g in opt.param_groups}),
        "amsgrad": d.get("amsgrad"),
        "param_groups": len(opt.param_groups),
    }


def describe(
    opt: torch.optim.Optimizer,
    model: torch.nn.Module,
    init_hash: str,
    batch_per_process: int,
    precision: str,
) -> None:
    """Rank 0's `bench_setup {json}` line: what this contender actually ran."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    setup = {
        **optimizer_settings(opt),
        "model": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "init_hash": init_hash,
        "batch_per_process": batch_per_process,
        "precision": precision,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
    }
    print(SETUP_PREFIX + json.dumps(setup), flush=True)
