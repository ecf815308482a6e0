"""The training loop behind `python -m kubellm.train`: DDP over the packed Parquet shards.

It reads only the standard torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so torchrun on a laptop, a PyTorchJob and a Katib trial run it unchanged.
Metrics go to stdout as `name=value` pairs (Katib's StdOut collector reads them) and, on
rank 0, to MLflow when a run is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kubellm.config import ConfigError, TrainConfig, parse_overrides, validate
from kubellm.data.prepare import DataError, load_manifest
from kubellm.data.tokenizer import load_tokenizer
from kubellm.jobs import format_metrics
from kubellm.model import build_model
from kubellm.train import checkpoint


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """`--config FILE` (JSON) then `--set key=value` overrides, validated as one TrainConfig."""
    parser = argparse.ArgumentParser(
        prog="python -m kubellm.train",
        description="Train the model on a kubellm dataset (run under torchrun).",
    )
    parser.add_argument("--config", help="TrainConfig as a JSON file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        values = json.loads(Path(args.config).read_text())
    values.update(parse_overrides(args.overrides, TrainConfig))
    return validate(TrainConfig, values)


def check(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """Everything that can be wrong before the process group starts; returns the manifest."""
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"invalid batch_size={cfg.batch_size}: must be divisible by WORLD_SIZE={world_size}"
        )
    try:
        manifest = load_manifest(cfg.dataset_dir)
    except DataError as err:
        raise ConfigError(f"invalid dataset_dir={cfg.dataset_dir!r}: {err}") from None
    seq_len = int(manifest["seq_len"])
    if seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"invalid model.max_position_embeddings={cfg.model.max_position_embeddings}: "
            f"the dataset's seq_len is {seq_len}"
        )
    return manifest


def load_split(dataset_dir: str, split: str) -> torch.Tensor:
    """Labels-ready rows: shape (2, N, seq_len), input ids and labels (-100 where masked)."""
    files = sorted((Path(dataset_dir) / split).glob("*.parquet"))
    if not files:
        raise DataError(f"{dataset_dir}/{split} has no Parquet shards")
    rows: list[list[int]] = []
    masks: list[list[int]] = []
    for f in files:
        table = pq.read_table(f)
        ids = table.column("input_ids").to_pylist()
        rows += ids
        if "loss_mask" in table.column_names:
            masks += table.column("loss_mask").to_pylist()
        else:
            masks += [[1] * len(r) for r in ids]
    x = torch.tensor(rows, dtype=torch.long)
    labels = x.masked_fill(torch.tensor(masks, dtype=torch.bool).logical_not(), -100)
    return torch.stack([x, labels])


def batch_indices(n: int, step: int, batch: int, seed: int) -> torch.Tensor:
    """Rows of the global batch at `step`: epochs are seeded permutations, so order is exact."""
    per_epoch = n // batch
    if per_epoch == 0:
        raise DataError(f"dataset has {n} sequences, fewer than one batch of {batch}")
    epoch, pos = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[pos * batch : (pos + 1) * batch]


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class _MlflowSink:
    """Rank 0's metric sink; a no-op without a run."""

    def __init__(self, uri: str, run_id: str) -> None:
        self.client = None
        self.run_id = run_id
        if uri and run_id:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=uri)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)


def _emit(metrics: dict[str, float], sink: _MlflowSink | None, step: int) -> None:
    print(format_metrics(metrics), flush=True)
    if sink is not None:
        sink.log({k: v for k, v in metrics.items() if k != "step"}, step)


def train(cfg: TrainConfig) -> dict[str, float]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    manifest = check(cfg, world)
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    distributed = world > 1
    if distributed:
        dist.init_process_group(backend=backend)
    device = torch.device("cpu")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    try:
        return _train(cfg, manifest, rank, world, device, distributed)
    finally:
        if distributed:
            dist.destroy_process_group()


def _train(
    cfg: TrainConfig,
    manifest: dict[str, Any],
    rank: int,
    world: int,
    device: torch.device,
    distributed: bool,
) -> dict[str, float]:
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(Path(cfg.dataset_dir) / "tokenizer")
    data = load_split(cfg.dataset_dir, "train")
    val = load_split(cfg.dataset_dir, "val")
    model: Any = build_model(cfg.model, tokenizer)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    ddp: torch.nn.Module = (
        DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None
        )
        if distributed
        else model
    )
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        betas=(0.9, cfg.adam_beta2),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps)
    )
    sink = _MlflowSink(cfg.mlflow_tracking_uri, cfg.mlflow_run_id) if rank == 0 else None
    if rank == 0:
        print(
            f"train: params={n_params} world_size={world} device={device.type} "
            f"sequences={data.shape[1]} seq_len={manifest['seq_len']} steps={cfg.steps}",
            flush=True,
        )
    per_rank = cfg.batch_size // world
    tokens_per_step = cfg.batch_size * data.shape[2]
    last: dict[str, float] = {}
    start = 0
    if cfg.checkpoint_dir:
        resumed = checkpoint.load_latest(cfg.checkpoint_dir, ddp, opt, sched)
        if resumed is not None:
            start = resumed.step
            if rank == 0:
                print(f"train: resumed from {resumed.path} at step {start}", flush=True)
    window_t = time.perf_counter()
    window_steps = 0
    ddp.train()
    for step in range(start, cfg.steps):
        idx = batch_indices(data.shape[1], step, cfg.batch_size, cfg.seed)
        x, y = data[:, idx[rank * per_rank : (rank + 1) * per_rank]].to(device)
        loss = ddp(input_ids=x, labels=y).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        window_steps += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            loss_v = loss.detach()
            if distributed:
                dist.all_reduce(loss_v, op=dist.ReduceOp.AVG)
            elapsed = time.perf_counter() - window_t
            last = {
                "step": step + 1,
                "loss": float(loss_v),
                "lr": float(sched.get_last_lr()[0]),
                "grad_norm": float(grad_norm),
                "tokens_per_sec": window_steps * tokens_per_step / max(elapsed, 1e-9),
            }
            if rank == 0:
                _emit(last, sink, step + 1)
            window_t, window_steps = time.perf_counter(), 0
        done = step + 1
        stopping = cfg.stop_after and done == cfg.stop_after
        periodic = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
        if cfg.checkpoint_dir and (stopping or periodic):
            path = checkpoint.save(
                cfg.checkpoint_dir, done, ddp, opt, sched, rank, cfg.keep_checkpoints
            )
            if rank == 0:
                print(f"train: checkpoint {path}", flush=True)
        if stopping:
            if rank == 0:
                print(f"train: stopped after step {done} (stop_after)", flush=True)
            return {"train_loss": last.get("loss", float("nan")), "stopped_at": float(done)}

    eval_loss = evaluate_loss(model, val, cfg.eval_batches, per_rank, rank, world, device)
    final = {
        "train_loss": last.get("loss", float("nan")),
        "eval_loss": eval_loss,
        "perplexity": math.exp(min(eval_loss, 50.0)),
    }
    if rank == 0:
        _emit(final, sink, cfg.steps)
    if rank == 0 and cfg.save_model:
        export(model, tokenizer, cfg.output_dir)
        print(f"train: exported model to {cfg.output_dir}", flush=True)
    return final


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    val: torch.Tensor,
    max_batches: int,
    per_rank: int,
    rank: int,
    world: int,
    device: torch.device,
) -> float:
    """Mean token loss over the first batches of the validation split, averaged over ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for b in range(max_batches):
        start = (b * world + rank) * per_rank
        x, y = val[:, start : start + per_rank].to(device)
        if len(x) == 0:
            break
        loss = model(input_ids=x, labels=y).loss
        total += torch.tensor([float(loss) * len(x), len(x)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return float(total[0] / max(float(total[1]), 1.0))


def export(model: torch.nn.Module, tokenizer: Any, output_dir: str) -> None:
    """Write the Hugging Face directory atomically: a temp name, then rename."""
    out = Path(output_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.eos_token_id = tokenizer.eos_token_id
        gen.pad_token_id = tokenizer.pad_token_id
        gen.do_sample = False
    model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
        train(cfg)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
