"""The training engine behind `python -m kubellm.train`: DDP or FSDP2 over the packed shards.

It reads only the standard torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so torchrun on a laptop, a PyTorchJob on 4 x 8 GPUs and a Katib trial run it
unchanged. The order of work:

1. `check`: everything that can be wrong with the config and the data, before any process
   group exists (a bad value fails in seconds, naming the field, with exit code 2);
2. the process group (NCCL on GPUs, gloo on CPU; under torchrun even with one rank, so the
   strategy is the same at any size), after a hub model is downloaded (`startup.resolve`, so
   no collective waits on a download); on NCCL with the flight recorder on and dumped on a
   watchdog timeout, bound to the rank's GPU, with `init_timeout_s` until the first step is
   done on every rank and `collective_timeout_s` afterwards (`process_group_setup`);
3. `build_model` (a pretrained model as a skeleton on `meta`, a from-config one on CPU), then
   `place`: DDP, or FSDP2 / HSDP `fully_shard` before the parameters get storage, and the
   pretrained weights read once on rank 0 and streamed to the others;
4. the loop: micro-batches with gradient accumulation, clipping, AdamW with warmup + cosine,
   metrics every `log_every` steps, DCP checkpoints, and SIGTERM / SIGUSR1 pre-emption;
5. held-out loss, then the model exported as a Hugging Face directory (LoRA merged, in
   `export_dtype`) by rank 0, the other ranks waiting for it on a gloo group with
   `export_timeout_s` (not under NCCL's watchdog).

Metrics go to stdout as `name=value` pairs (Katib's StdOut collector reads them) and, on
rank 0, to MLflow when a run is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kubellm.config import ConfigError, TrainConfig, parse_overrides, validate
from kubellm.data.artifact import load_manifest, tokenizer_dir
from kubellm.data.records import DataError
from kubellm.data.tokenizer import load_tokenizer
from kubellm.train import checkpoint, gpus, mfu, shards, startup
from kubellm.train.loader import DistributedLoader
from kubellm.train.metric_lines import format_metrics
from kubellm.train.metrics_sink import MlflowSink
from kubellm.train.model import (
    activation_checkpointing,
    build_model,
    export,
    hf_config,
    place,
    tie_weights,
)
from kubellm.train.preempt import EXIT_PREEMPTED, Preemption

FORCE_DISTRIBUTED_ENV = "KUBELLM_FORCE_DISTRIBUTED"
# What the NCCL process group reads when it is created (torch/csrc/distributed/c10d/
# ProcessGroupNCCL.hpp, FlightRecorder.hpp), as torchtitan's init_distributed sets them: the
# watchdog tears the process down on an error or timeout without cleaning up the communicators
# (3, SkipCleanUp: the mode the flight recorder's dump works with, pytorch/pytorch#121055),
# after dumping the last collectives of every group (ring buffer of 2000 entries) to a file per
# rank. Each entry: the names torch reads for it, newest first (one already set, under any of
# its names, is left as it is), and the value. The dump file prefix is added by
# `process_group_setup` when the run has a checkpoint_dir (a volume that outlives the pod).
NCCL_ENV: list[tuple[tuple[str, ...], str]] = [
    (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"), "3"),
    (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
    (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), "2000"),
]
FR_DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
FLIGHT_RECORDER_DIR = "flight-recorder"  # under checkpoint_dir: <rank>-numbered dumps
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Preempted(Exception):
    """Training stopped on SIGTERM / SIGUSR1 after writing a checkpoint."""


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """`--config FILE` (JSON) then `--set key=value` overrides, validated as one TrainConfig."""
    parser = argparse.ArgumentParser(
        prog="python -m kubellm.train",
        description="Train the model on a kubellm dataset (run under torchrun).",
    )
    parser.add_argument("--config", help="TrainConfig as a JSON file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.overrides, TrainConfig)
    if not args.config:
        return validate(TrainConfig, overrides)
    base = validate(TrainConfig, json.loads(Path(args.config).read_text()))
    return base.with_values(overrides)


@dataclass
class Plan:
    """What `check` established: the run's shapes, and the pieces it already loaded."""

    tokenizer: Any
    micro_batch: int
    seq_len: int
    device: torch.device
    backend: str
    bf16: bool
    local_world: int = 1  # ranks per node (torchrun's LOCAL_WORLD_SIZE): HSDP's shard size


def check(cfg: TrainConfig, world_size: int, local_rank: int = 0, local_world: int = 0) -> Plan:
    """Everything that can be wrong before the process group starts."""
    micro = cfg.micro_batch(world_size)
    local_world = local_world or world_size
    if cfg.strategy == "hsdp" and world_size % local_world:
        raise ConfigError(
            f"invalid strategy='hsdp': WORLD_SIZE {world_size} is not a whole number of nodes "
            f"of LOCAL_WORLD_SIZE {local_world}"
        )
    try:
        manifest = load_manifest(cfg.dataset_dir)
        tok_dir = tokenizer_dir(cfg.dataset_dir)
        if not tok_dir.is_dir():
            raise DataError(f"{tok_dir.name}/ is missing")
        tokenizer = load_tokenizer(tok_dir)
        # every shard against its manifest digest, into the node's memory-mapped cache
        shards.verify(cfg.dataset_dir)
    except (DataError, OSError, ValueError) as err:
        raise ConfigError(f"invalid dataset_dir={cfg.dataset_dir!r}: {err}") from None
    seq_len = int(manifest["seq_len"])
    if cfg.model_name_or_path:
        hf = hf_config(cfg)
        limit = getattr(hf, "max_position_embeddings", None)
        if limit is not None and seq_len > limit:
            raise ConfigError(
                f"invalid model_name_or_path={cfg.model_name_or_path!r}: its "
                f"max_position_embeddings is {limit}, the dataset's seq_len is {seq_len}"
            )
        vocab = getattr(hf, "vocab_size", None)
        if vocab is not None and len(tokenizer) > vocab:
            raise ConfigError(
                f"invalid model_name_or_path={cfg.model_name_or_path!r}: its vocab_size is "
                f"{vocab} but the dataset's tokenizer has {len(tokenizer)} tokens; prepare the "
                "data with the model's tokenizer (tokenizer=<the same name>)"
            )
        if Path(cfg.model_name_or_path).is_dir():
            startup.weight_files(Path(cfg.model_name_or_path))  # safetensors, or a ConfigError
    elif seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"invalid model.max_position_embeddings={cfg.model.max_position_embeddings}: "
            f"the dataset's seq_len is {seq_len}"
        )
    cuda = torch.cuda.is_available()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        # A pipeline that asks for GPUs (gpus_per_node > 0) demands nccl: say why there are
        # none (torch's own reason: a CPU-only build, no driver, a driver too old, ...).
        raise ConfigError(
            f"invalid backend='nccl': {gpus.cuda_unusable()}. A pipeline with gpus_per_node > 0 "
            "demands nccl; to train on the CPU set gpus_per_node=0 (by hand: backend=gloo or "
            "auto)"
        )
    if backend == "nccl" and (missing := gpus.too_few_gpus(local_rank, local_world)):
        cpu = ", or CUDA_VISIBLE_DEVICES= to train on the CPU" if cfg.backend == "auto" else ""
        raise ConfigError(
            f"invalid nproc_per_node={max(local_world, local_rank + 1)}: {missing}; run one "
            f"process per GPU: nproc_per_node (kubellm train --nproc) <= "
            f"{torch.cuda.device_count()}{cpu}"
        )
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    bf16 = cfg.precision == "bf16" or (
        cfg.precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    )
    return Plan(tokenizer, micro, seq_len, device, backend, bf16, local_world)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _emit(metrics: dict[str, float], sink: MlflowSink | None, step: int) -> None:
    print(format_metrics(metrics), flush=True)
    if sink is not None:
        sink.log({k: v for k, v in metrics.items() if k != "step"}, step)


def process_group_setup(
    plan: Plan, cfg: TrainConfig, env: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, Any]]:
    """(the environment variables to add, the keyword arguments of init_process_group).

    The timeout is `init_timeout_s` (the run switches to `collective_timeout_s` after its
    first step, `_Run.settle_timeouts`). On NCCL also: the flight recorder and the watchdog's
    error handling (`NCCL_ENV`, each only when `env` has none of its names: the user's
    setting wins), the dump file prefix under checkpoint_dir, and `device_id`, so the
    communicator is created now (a broken NCCL set-up fails here, not in the first step) and
    sub-groups are split from it. On gloo nothing else.
    """
    kwargs: dict[str, Any] = {
        "backend": plan.backend,
        "timeout": timedelta(seconds=cfg.init_timeout_s),
    }
    if plan.backend != "nccl":
        return {}, kwargs
    wanted = list(NCCL_ENV)
    if cfg.checkpoint_dir:
        prefix = Path(cfg.checkpoint_dir) / FLIGHT_RECORDER_DIR / "nccl_trace_rank_"
        wanted.append((FR_DUMP_FILE, str(prefix)))
    updates = {names[0]: value for names, value in wanted if not any(n in env for n in names)}
    kwargs["device_id"] = plan.device
    return updates, kwargs


def settled(device: torch.device) -> float:
    """The clock, read once `device` has run all the work queued so far.

    A CUDA kernel launch returns before the kernel runs: a clock read without waiting ends
    the metrics window while the GPU still has the window's last steps queued, overstating
    tokens/s and MFU.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def train(cfg: TrainConfig) -> dict[str, float]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    plan = check(cfg, world, local_rank, local_world)
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    else:
        return_freed_memory()
    if cfg.model_name_or_path:
        # A hub model is downloaded now, by every rank, before any collective could time out
        # waiting for it; `place` later gets the same snapshot without downloading again.
        startup.resolve(cfg.model_name_or_path)
    # One process trains the plain model; FORCE_DISTRIBUTED_ENV=1 gives it a process group
    # and the configured strategy anyway (`make gpu-check` exercises DDP / FSDP2 on one GPU).
    if world > 1 or os.environ.get(FORCE_DISTRIBUTED_ENV) == "1":
        env, kwargs = process_group_setup(plan, cfg, os.environ)
        os.environ.update(env)
        if dump := env.get(FR_DUMP_FILE[0]):
            Path(dump).parent.mkdir(parents=True, exist_ok=True)
        dist.init_process_group(**kwargs)
        if rank == 0 and plan.backend == "nccl":
            groups = [names for names, _ in NCCL_ENV] + [FR_DUMP_FILE]
            found = [next((n for n in g if n in os.environ), "") for g in groups]
            print(
                f"train: nccl: timeout {cfg.init_timeout_s}s until the first step, then "
                f"{cfg.collective_timeout_s}s; "
                + " ".join(f"{n}={os.environ[n]}" for n in found if n),
                flush=True,
            )
    try:
        model = build_model(cfg, plan.tokenizer)
        return _Run(cfg, plan, model, rank, world).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Run:
    """One training run on one rank."""

    def __init__(
        self, cfg: TrainConfig, plan: Plan, model: torch.nn.Module, rank: int, world: int
    ) -> None:
        self.cfg, self.plan, self.rank, self.world = cfg, plan, rank, world
        self.distributed = dist.is_initialized()
        self.sharded = self.distributed and cfg.strategy in ("fsdp", "hsdp")
        self.model = model  # unwrapped (FSDP2 shards it in place; DDP wraps it)
        self.engine = place(
            model,
            cfg,
            plan.device,
            plan.bf16,
            distributed=self.distributed,
            rank=rank,
            local_world=plan.local_world,
        )
        self.startup_rss = host_peak_rss()
        self.params = [p for p in model.parameters() if p.requires_grad]
        # One fused kernel per step for every strategy (FSDP2's DTensor parameters too, as
        # torchtitan does).
        self.opt = torch.optim.AdamW(
            self.params,
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            betas=(0.9, cfg.adam_beta2),
            fused=True,
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps)
        )
        self.loader = DistributedLoader(
            shards.open_split(cfg.dataset_dir, "train"),
            global_batch=cfg.batch_size,
            micro_batch=plan.micro_batch,
            rank=rank,
            world_size=world,
            seed=cfg.seed,
            device=plan.device,
        )
        self.val = shards.open_split(cfg.dataset_dir, "val")
        # Asynchronous DCP checkpoints; LoRA runs skip the frozen base (it is reloaded from
        # the pretrained weights, or rebuilt from the seed, at every start).
        self.ckpt = (
            checkpoint.Checkpointer(
                cfg.checkpoint_dir, rank, cfg.keep_checkpoints, skip_frozen=cfg.lora is not None
            )
            if cfg.checkpoint_dir
            else None
        )
        self.sink = MlflowSink(cfg.mlflow_tracking_uri, cfg.mlflow_run_id) if rank == 0 else None

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"train: {msg}", flush=True)

    def log_memory(self, when: str, peak: int, group: dist.ProcessGroup | None = None) -> None:
        """Every rank's host peak RSS (and the device's peak allocation) in one line
        (collective, on `group`: the default one unless given)."""
        per_rank: list[Any] = [peak]
        if self.distributed:
            per_rank = [0] * dist.get_world_size()
            dist.all_gather_object(per_rank, peak, group=group)
        device = ""
        if self.plan.device.type == "cuda":
            device = f"; device peak {_gib(torch.cuda.max_memory_allocated(self.plan.device))} GiB"
        self.log(
            f"{when}: host peak RSS per rank [{', '.join(_gib(p) for p in per_rank)}] GiB, "
            f"sum {_gib(sum(per_rank))} GiB{device}"
        )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        # FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and one process autocast.
        on = self.plan.bf16 and not self.sharded
        return torch.autocast(self.plan.device.type, dtype=torch.bfloat16, enabled=on)

    def _sync_grads(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """What each micro-batch's backward communicates.

        DDP: the all-reduce only on the last micro-batch (`no_sync` before; the gradients are
        full-size anyway). FSDP2: a reduce-scatter after every micro-batch, so what
        accumulates is this rank's shard; skipping it would accumulate full unsharded fp32
        gradients on every rank and undo the sharding. HSDP: the reduce-scatter within the
        node every micro-batch, the all-reduce across nodes only on the last.
        """
        if self.sharded:
            if self.cfg.strategy == "hsdp":
                self.engine.set_requires_all_reduce(last)  # type: ignore[operator]
            return contextlib.nullcontext()
        if self.distributed and not last:
            assert isinstance(self.engine, DistributedDataParallel)
            return self.engine.no_sync()
        return contextlib.nullcontext()

    def trainer_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "scheduler": self.sched.state_dict(),
            "loader": self.loader.state_dict(),
            "rng": torch.get_rng_state(),
        }
        if self.plan.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.plan.device)
        return state

    def settle_timeouts(self) -> None:
        """After this process's first step: the default group's collectives may wait
        `collective_timeout_s` from now on, instead of start-up's `init_timeout_s`
        (torchtitan's set_pg_timeouts). A barrier first, and the device idle, so that no rank
        waits under the shorter timeout for one still busy with its first step."""
        if not self.distributed:
            return
        from torch.distributed import distributed_c10d

        set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is None:  # private (torchtitan calls it): feature-tested
            self.log(f"this torch cannot change a timeout: {self.cfg.init_timeout_s}s stays")
            return
        dist.barrier()
        if self.plan.device.type == "cuda":
            torch.cuda.synchronize(self.plan.device)
        set_timeout(timedelta(seconds=self.cfg.collective_timeout_s))

    def save(self, step: int, *, block: bool) -> None:
        """Start checkpoint `step` (the write continues in the background unless `block`)."""
        assert self.ckpt is not None
        path = self.ckpt.save(step, self.engine, self.opt, self.trainer_state())
        if block:
            self.ckpt.wait()
            self.log(f"checkpoint {path}")
        else:
            self.log(f"checkpoint {path}: writing in the background")

    def close_checkpoints(self) -> None:
        if self.ckpt is not None and (path := self.ckpt.close()) is not None:
            self.log(f"checkpoint {path} committed")

    def resume(self) -> int:
        if self.ckpt is None:
            return 0
        resumed = self.ckpt.load_latest(self.engine, self.opt)
        if resumed is None:
            return 0
        state = resumed.trainer
        self.sched.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and self.plan.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.plan.device)
        step = int(state["step"])
        self.log(f"resumed from {resumed.path} at step {step}")
        return step

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss on this rank, total grad norm)."""
        micro = self.loader.next_batch()
        total = torch.zeros((), device=self.plan.device)
        for i, (x, y) in enumerate(micro):
            total += self.micro_step(x, y, len(micro), last=i == len(micro) - 1)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return total, norm

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, parts: int, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch (1/parts of the step); its loss share."""
        with self._sync_grads(last), self.autocast():
            loss = self.engine(input_ids=x, labels=y).loss / parts
        loss.backward()
        return loss.detach()

    def run(self) -> dict[str, float]:
        try:
            return self._run()
        finally:
            self.loader.close()  # the prefetch thread
            self.close_sink()

    def close_sink(self) -> None:
        """Flush the buffered MLflow points (a deadline, never forever) and say what was
        dropped; the count goes to MLflow too when the server takes it."""
        if self.sink is None or self.sink.client is None:
            return
        self.sink.log({"mlflow_dropped_points": float(self.sink.dropped)}, self.cfg.steps)
        report = self.sink.close()
        why = f" (last error: {report.last_error})" if report.dropped and report.last_error else ""
        self.log(f"mlflow: {report.sent} metric points sent, {report.dropped} dropped{why}")

    def _run(self) -> dict[str, float]:
        cfg, plan = self.cfg, self.plan
        n_params = sum(p.numel() for p in self.model.parameters())
        n_train = sum(p.numel() for p in self.params)
        self.log(
            f"params={n_params} trainable={n_train} world_size={self.world} "
            f"device={plan.device.type} "
            f"strategy={cfg.strategy if self.distributed else 'single'} "
            f"precision={'bf16' if plan.bf16 else 'fp32'} sequences={self.loader.num_sequences} "
            f"seq_len={plan.seq_len} micro_batch={plan.micro_batch} "
            f"grad_accum_steps={cfg.grad_accum_steps} steps={cfg.steps}"
        )
        self.log_memory("start-up", self.startup_rss)
        tokens_per_step = cfg.batch_size * plan.seq_len
        fpt = mfu.model_flops_per_token(self.model, plan.seq_len)
        peak, peak_line = mfu.peak_or_reason(plan.device)
        self.log(peak_line)
        start = self.resume()
        last: dict[str, float] = {}
        began = window_t = settled(plan.device)
        # the progress line about every 10 % (metrics go out every log_every steps, which
        # the train stage sets for ~100 points on the loss curve: too many lines to read)
        progress_every = max(1, cfg.steps // 10)
        next_progress = start + progress_every
        window_steps = 0
        self.engine.train()
        control = dist.new_group(backend="gloo") if self.world > 1 else None
        # What the other ranks wait on while rank 0 exports (`log_memory("end")`): gloo with
        # its own long timeout, so a long write is not killed by NCCL's watchdog.
        finish = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.export_timeout_s))
            if self.distributed
            else None
        )
        with Preemption(control) as pre:
            for step in range(start, cfg.steps):
                loss, norm = self.step()
                if step == start:
                    self.settle_timeouts()
                done = step + 1
                window_steps += 1
                if done % cfg.log_every == 0 or done == cfg.steps:
                    if dist.is_initialized():
                        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
                        loss /= self.world
                    # float() waits for the device; the window ends once it has run it all
                    loss_value, norm_value = float(loss), float(norm)
                    elapsed = max(settled(plan.device) - window_t, 1e-9)
                    tps = window_steps * tokens_per_step / elapsed
                    last = {
                        "step": done,
                        "loss": loss_value,
                        "lr": float(self.sched.get_last_lr()[0]),
                        "grad_norm": norm_value,
                        "tokens_per_sec": tps,
                    }
                    if peak:
                        last["mfu"] = tps * fpt / self.world / peak
                    if plan.device.type == "cuda":
                        last["peak_mem_gb"] = torch.cuda.max_memory_allocated(plan.device) / 2**30
                    if self.rank == 0:
                        _emit(last, self.sink, done)
                    if self.rank == 0 and (done >= next_progress or done == cfg.steps):
                        next_progress = done + progress_every
                        rate = (done - start) / (time.perf_counter() - began)
                        self.log(
                            f"{done}/{cfg.steps} steps ({100 * done / cfg.steps:.0f}%), "
                            f"eta {_duration((cfg.steps - done) / rate)}"
                        )
                    window_t, window_steps = time.perf_counter(), 0
                preempted = pre.poll()
                if preempted:
                    pre.drain()
                stopping = bool(cfg.stop_after) and done == cfg.stop_after
                periodic = bool(cfg.checkpoint_every) and done % cfg.checkpoint_every == 0
                if self.ckpt is not None:
                    if stopping or periodic or preempted:
                        self.save(done, block=stopping or preempted)
                    elif (path := self.ckpt.poll()) is not None:
                        self.log(f"checkpoint {path} committed")
                if preempted:
                    where = "checkpoint written" if cfg.checkpoint_dir else "no checkpoint_dir"
                    self.log(
                        f"pre-empted by {pre.name} after step {done} ({where}); "
                        f"exiting with {EXIT_PREEMPTED}"
                    )
                    self.close_checkpoints()
                    raise Preempted
                if stopping:
                    self.close_checkpoints()
                    self.log(f"stopped after step {done} (stop_after)")
                    return {"train_loss": last.get("loss", math.nan), "stopped_at": float(done)}
        self.close_checkpoints()  # the last periodic write committed, old ones deleted
        eval_loss = self.evaluate()
        final = {
            "train_loss": last.get("loss", math.nan),
            "eval_loss": eval_loss,
            "perplexity": math.exp(min(eval_loss, 50.0)),
        }
        if self.rank == 0:
            _emit(final, self.sink, cfg.steps)
        if cfg.save_model:
            self.export()
        self.log_memory("end", host_peak_rss(), group=finish)
        return final

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the first validation batches, the same count on every rank."""
        val = self.val
        n = val.num_sequences
        size = max(1, min(self.plan.micro_batch, n // self.world))
        batches = max(1, min(self.cfg.eval_batches, n // (size * self.world)))
        self.engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.plan.device)
        for b in range(batches):
            first = ((b * self.world + self.rank) * size) % max(1, n - size + 1)
            x, y = val.rows(torch.arange(first, first + size)).long().to(self.plan.device)
            with self.autocast():
                loss = self.engine(input_ids=x, labels=y).loss
            total += weighted(loss, len(x))
        if dist.is_initialized():
            dist.all_reduce(total)
        self.engine.train()
        return float(total[0] / total[1])

    def export(self) -> None:
        """The Hugging Face directory: full weights gathered to rank 0, LoRA merged."""
        model = self.model
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            full = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if self.rank != 0:
                return
            # The gathered tensors become the skeleton's parameters (assign): no second copy.
            skeleton = self.cfg.model_copy(update={"compile": False})
            model = build_model(skeleton, self.plan.tokenizer, meta=True)
            model.load_state_dict(full, assign=True)
            tie_weights(model)
        if self.rank != 0:
            return
        if self.cfg.lora is not None:
            model = model.merge_and_unload()  # type: ignore[operator]
        if self.cfg.activation_checkpointing:
            activation_checkpointing(model, False)
        model.config.use_cache = True  # type: ignore[union-attr]  # generation uses the cache
        # floating-point tensors only (`Module.to`); after the LoRA merge, made in float32
        dtype = EXPORT_DTYPES[self.cfg.export_dtype]
        export(model.to("cpu", dtype), self.plan.tokenizer, self.cfg.output_dir)
        self.log(f"exported model to {self.cfg.output_dir} ({self.cfg.export_dtype})")


def return_freed_memory(threshold: int = 4 << 20) -> None:
    """glibc: serve every allocation of `threshold` bytes or more with mmap, so freeing it
    returns it to the OS. By default glibc raises that threshold (up to 32 MiB) each time
    a large block is freed, and freed heap blocks then stay in the process: on CPU, FSDP2's
    per-layer all-gather buffers (tens of MiB each) grew every rank's RSS by ~2 GiB in one
    step of a 1B model (docs/benchmarks-startup.md). No-op without glibc."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD


def host_peak_rss() -> int:
    """This process's peak resident memory so far, bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def weighted(loss: torch.Tensor, count: int) -> torch.Tensor:
    """(loss x count, count) in float64 on the loss's device: a mean's parts, ready for one
    all_reduce (a tensor made on the CPU here would fail every GPU run at this point)."""
    n = torch.tensor(count, dtype=torch.float64, device=loss.device)
    return torch.stack([loss.double() * n, n])


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad config or data, EXIT_PREEMPTED (200) checkpointed on a signal."""
    try:
        cfg = load_config(argv)
        train(cfg)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except Preempted:
        return EXIT_PREEMPTED
    return 0
