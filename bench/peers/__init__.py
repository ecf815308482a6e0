"""What the training-throughput peers share: config, data, schedule, device and the clock.

The peers (`hf_trainer`, `ddp_loop`) are run by `bench.train_bench` under torchrun, on the
same TrainConfig JSON that `python -m kubellm.train --config` gets, so the three contenders
cannot drift apart on model shape, batch, steps or optimizer settings. The helpers here
import nothing from `kubellm.train` (the engine under test): a peer that borrowed the
engine's code would measure the engine, not itself.

Each peer prints, on rank 0, `bench_step=K` marks (at the end of the warmup skip and of
the last step; the parent timestamps them as a cross-check) and one result line:
`bench_tokens_per_sec=... bench_loss=... bench_params=... bench_threads=...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch


def parse_args(description: str) -> argparse.Namespace:
    """`--config FILE` (the TrainConfig JSON kubellm.train reads) and `--skip N`."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", required=True, help="TrainConfig JSON (kubellm.train's)")
    ap.add_argument("--skip", type=int, required=True, help="warmup steps left out of the rate")
    return ap.parse_args()


def read_config(path: str) -> dict[str, Any]:
    """The JSON as a dict with TrainConfig's defaults for the fields the peers use."""
    cfg: dict[str, Any] = {
        "steps": 300,
        "batch_size": 32,
        "learning_rate": 3e-3,
        "weight_decay": 0.0,
        "warmup_steps": 20,
        "grad_clip": 1.0,
        "seed": 0,
        "log_every": 20,
        "adam_beta2": 0.999,
        "backend": "auto",
        "precision": "fp32",
        "model": {},
    }
    cfg.update(json.loads(Path(path).read_text()))
    return cfg


def load_rows(dataset_dir: str, split: str = "train") -> torch.Tensor:
    """Shape (2, N, seq_len): input ids and labels (-100 where loss_mask is 0).

    Read through numpy (not Python lists): the load is outside the timed steps either way,
    but it keeps the peers' start-up short.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted((Path(dataset_dir) / split).glob("*.parquet"))
    if not files:
        raise SystemExit(f"{dataset_dir}/{split} has no Parquet shards")
    table = pa.concat_tables(pq.read_table(f) for f in files)

    def matrix(name: str) -> Any:
        col = table.column(name).combine_chunks()
        flat = col.flatten().to_numpy(zero_copy_only=False)
        return flat.reshape(len(col), -1)

    ids = torch.from_numpy(matrix("input_ids").astype(np.int64))
    labels = ids.clone()
    if "loss_mask" in table.column_names:
        mask = torch.from_numpy(matrix("loss_mask").astype(np.bool_))
        labels = labels.masked_fill(~mask, -100)
    return torch.stack([ids, labels])


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10 % of the peak (the engine's documented schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix: 6 x non-embedding params + 12·L·H·Q·T.

    The same formula the engine's MFU uses, so achieved FLOP/s compare across contenders.
    """
    c: Any = model.config
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()  # type: ignore[operator]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = 12.0 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq_len
    return 6.0 * (n_params - n_embed) + attention


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
        """The result line (rank 0), `name=value` pairs that kubellm.jobs.parse_metrics reads."""
        if self.rank != 0:
            return
        params = sum(p.numel() for p in model.parameters())
        print(
            f"bench_tokens_per_sec={self.tokens_per_sec():.6g} bench_loss={loss:.6g} "
            f"bench_params={params} bench_flops_per_token={flops_per_token(model, seq_len):.6g} "
            f"bench_threads={torch.get_num_threads()}",
            flush=True,
        )
        print(f"bench: device {self.device}", flush=True)
