"""gpu-check: can this GPU machine, as it comes, train with kubellm? Five timed stages, one
command, fail-fast; `summary.json` and `summary.md` are always written to the --out folder.

On the borrowed GPU machine (its image's own python3 with torch, transformers, tokenizers,
safetensors, pyarrow, numpy, peft, but no pydantic and no network; no venv is built there),
from the repository root, after `make gpu-bundle` here and with `.gpu-bundle` in the device
tool's carry list:

    PYTHONPATH=src:.gpu-bundle/site python3 bench/gpu_check.py --out $OUT

Elsewhere:

    make gpu-check                                  # a CUDA box with the project venv
    python -m bench.gpu_check [--out DIR] [--stages a,b] [--nproc N] [--keep]
    python bench/gpu_check.py --dry-run --out DIR   # the same stages on the CPU, tiny sizes

`make gpu-bundle` puts the wheels the training path imports at module level and the image
lacks (pydantic, pydantic-core, annotated-types, typing-inspection, zstandard: kubellm.config
and kubellm.data.sources) unzipped in `.gpu-bundle/site`, and fails when it is 64 MiB or more
(what one device run carries, working tree included).

The stages (what each figure means, the anchor it is compared with: docs/benchmarks.md):

1. versions: python, torch, CUDA, cuDNN, NCCL, transformers, the driver (when nvidia-smi is
   there), the device and its memory, its entry in the peak table
   (`kubellm.train.mfu.GPU_PEAK_BF16`: 989 TFLOP/s dense bf16 for an H100 SXM or an H200),
   and a bf16 8192^3 matmul timed between CUDA events (5 warm-ups, the mean of 50): the
   achievable peak, stage 4's second MFU denominator. Fails without a GPU, when pydantic,
   zstandard, kubellm.config or kubellm.data.prepare do not import (the bundle is not on
   PYTHONPATH), or when the product is wrong (a 64-row slice against float32) or not finite.
2. tiny: a small Llama (hidden 256, 4 layers, 256-token rows, an 8,192-token BPE that prepare
   trains on a generated 8 MiB corpus) under `torchrun` around `python -m kubellm.train`
   (one process per GPU, nccl, bf16; KUBELLM_FORCE_DISTRIBUTED=1, so one GPU still gets a
   process group and the strategy): DDP 20 steps; FSDP2 20 steps with deterministic kernels
   and every step's loss printed; FSDP2 again to a DCP checkpoint at step 10 (stop_after)
   and a run resuming from it to 20: every step's loss, the final loss and every exported
   tensor must be bit-identical to the 20 straight steps; then both exports loaded by
   transformers in a fresh process, their loss on the engine's validation rows equal to its
   eval_loss (3 % in bf16), 8 tokens generated greedily. Finite, falling losses; the strategy
   the engine reports is the one asked for.
3. lora: FSDP2 + LoRA (r 8 on q/k/v/o) + per-layer torch.compile + activation checkpointing,
   `model_name_or_path` = stage 2's FSDP2 export: the pretrained start-up (a meta-device
   skeleton, rank 0 reads the weights and broadcasts them), PEFT under fully_shard, the
   LoRA-merged export. Passes when the engine ran fsdp, only the adapters train, the losses
   are finite and the held-out loss is the pretrained model's (nearer stage 2's eval_loss
   than a new model's ln(vocab)): the weights arrived.
4. anchor: a nanochat-d12-like Llama (hidden 768, 12 layers, 6 heads of 128, SwiGLU MLP 2048
   (the FLOPs of nanochat's 4x768 relu^2 MLP), 2,048-token rows, a 32,768-token BPE on the
   same corpus), bf16, one process (no torchrun: strategy single), 32 sequences per step (2
   micro-batches of 16), 40 steps eager, then 40 compiled. tokens/s: the engine's metric
   windows after the first (warm-up and compilation left out), which the engine ends after
   the GPU has run their work (kubellm.train.loop.settled); MFU = tokens/s x the PaLM FLOPs
   per token (kubellm.train.mfu) over the data-sheet peak and over stage 1's matmul; peak memory
   (max_memory_allocated). Anchors: nanochat d12 ~41 % MFU on one H100; torchtitan
   Llama3-8B 33-39 % on 8 x H100. Figures only: no MFU threshold.
5. fabric: `torchrun -m kubellm.train.fabric` on every GPU (nccl, 256 MiB all-reduce): NCCL
   initialises and all-reduces; with one GPU a loopback all-reduce (busbw 0 by definition).

Sized to finish in under 7 minutes on one H200 (an estimate: no GPU has run it yet);
--budget-s says in summary.json whether it did. It stops at the first failing stage (and
within stage 2 at the first failing check); exit status 0 when every stage passed, else 1.
summary.json (written after every stage, and on the way out whatever happened) holds each
stage's result, seconds, figures, problem and log tail, the stages not run, the plan and the
machine; every child's output is under --out/logs.

`--dry-run` runs the same stages on the CPU: gloo, float32, one process like the GPU
machine, tiny sizes (hidden 32, a 512-token BPE on 0.25 MiB, 64-token rows), torch.compile
with the "eager" backend (dynamo traces every layer, no code is generated: inductor takes
minutes of CPU), a 512^3 float32 matmul; the data-sheet MFU is then n/a. To cost less CPU
than the runs it replaced, one-process runs start the rank directly with torchrun's
environment (stage 2's ddp run keeps torchrun: the GPU's command line), and stage 4 runs
only compiled (the eager run differs by the compile flag alone). That is what
tests/bench/test_gpu_check.py runs: the test of this script, not of any hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and not __package__:  # `python3 bench/gpu_check.py`
    sys.path[:1] = [str(REPO), str(REPO / "src")]  # not bench/: the repository's packages

FORCE_DISTRIBUTED_ENV = "KUBELLM_FORCE_DISTRIBUTED"  # kubellm.train.loop's (checked there)
STAGE_ORDER = ("versions", "tiny", "lora", "anchor", "fabric")
TITLES = {
    "versions": "versions, device, peak table, timed matmul",
    "tiny": "tiny model: DDP, FSDP2, checkpoint + bit-exact resume, export reloaded",
    "lora": "FSDP2 + LoRA + compile + activation checkpointing from the export",
    "anchor": "throughput anchor: nanochat-d12-like, eager and compiled, one process",
    "fabric": "fabric: NCCL init and all-reduce",
}
GENERATE_PREFIX = "gpu_check_generate "
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# MFU anchors the anchor stage's figures are read against (docs/benchmarks.md)
ANCHORS = (
    "nanochat d12 (768 wide, 12 layers, seq 2048): ~41 % MFU on one H100",
    "torchtitan Llama3-8B: 33-39 % MFU on 8 x H100",
)
NOT_PROVEN = (
    "multi-node traffic or RDMA (`kubellm.train.fabric --require-rdma` in a multi-node job), "
    "bandwidth or throughput targets, memory headroom of large models, long-run stability, "
    "HSDP, resume on another world size or after a crash or signal (tests/train on CPU), "
    "serving."
)


# --- sizes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one gpu-check run; every engine config is made from it."""

    dry_run: bool
    nproc: int  # stages 2, 3 and 5 (stage 4 is always one process)
    threads: int  # OMP_NUM_THREADS per process
    corpus_mb: float
    # stage 1
    matmul_n: int
    matmul_warmup: int
    matmul_iters: int
    # stages 2 and 3: the tiny model
    vocab: int
    seq_len: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    batch_per_proc: int  # sequences per process per optimizer step
    grad_accum: int
    steps: int  # ddp, fsdp; the checkpoint at steps // 2
    log_every: int
    learning_rate: float
    warmup_steps: int
    eval_batches: int
    lora_steps: int
    lora_rank: int
    # stage 4: the anchor
    anchor_vocab: int
    anchor_seq_len: int
    anchor_hidden: int
    anchor_layers: int
    anchor_heads: int
    anchor_intermediate: int
    anchor_batch: int
    anchor_grad_accum: int
    anchor_steps: int
    anchor_log_every: int
    anchor_learning_rate: float
    anchor_modes: tuple[str, ...]  # eager, compiled
    compile_backend: str  # "" (inductor, torch's default) or a cheap one for the CPU
    # one-process runs start the rank directly, with the environment torchrun would give it
    # (each launcher costs ~2.6 s of CPU), except stage 2's ddp run
    direct_launch: bool
    timeout: float  # seconds per child process
    new_tokens: int = 8

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    @property
    def batch(self) -> int:
        return self.batch_per_proc * self.nproc

    @property
    def micro_batch(self) -> int:
        return self.batch_per_proc // self.grad_accum

    @property
    def stop(self) -> int:
        return self.steps // 2

    @property
    def backend(self) -> str:
        return "gloo" if self.dry_run else "nccl"

    @property
    def precision(self) -> str:
        return "fp32" if self.dry_run else "bf16"

    @property
    def loss_rtol(self) -> float:
        """How close the export's loss must be to the engine's eval_loss."""
        return 1e-3 if self.dry_run else 3e-2


GPU: dict[str, Any] = {
    "corpus_mb": 8.0,
    "matmul_n": 8192,
    "matmul_warmup": 5,
    "matmul_iters": 50,
    "vocab": 8192,
    "seq_len": 256,
    "hidden": 256,
    "layers": 4,
    "heads": 4,
    "intermediate": 768,
    "batch_per_proc": 8,
    "grad_accum": 2,
    "steps": 20,
    "log_every": 5,
    "learning_rate": 1e-3,
    "warmup_steps": 4,
    "eval_batches": 2,
    "lora_steps": 20,
    "lora_rank": 8,
    "anchor_vocab": 32768,
    "anchor_seq_len": 2048,
    "anchor_hidden": 768,
    "anchor_layers": 12,
    "anchor_heads": 6,
    "anchor_intermediate": 2048,
    "anchor_batch": 32,
    "anchor_grad_accum": 2,
    "anchor_steps": 40,
    "anchor_log_every": 10,
    "anchor_learning_rate": 1e-3,
    "anchor_modes": ("eager", "compiled"),
    "compile_backend": "",
    "direct_launch": False,
    "timeout": 300.0,
}
# Each process start (torch, transformers) costs more CPU than all the steps: few of them.
DRY_RUN: dict[str, Any] = {
    "corpus_mb": 0.25,
    "matmul_n": 512,
    "matmul_warmup": 2,
    "matmul_iters": 10,
    "vocab": 512,
    "seq_len": 64,
    "hidden": 32,
    "layers": 1,
    "heads": 2,
    "intermediate": 64,
    "batch_per_proc": 4,
    "grad_accum": 2,
    "steps": 20,
    "log_every": 5,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
    "eval_batches": 2,
    "lora_steps": 4,
    "lora_rank": 4,
    "anchor_vocab": 512,  # stage 2's dataset again: no second prepare
    "anchor_seq_len": 64,
    "anchor_hidden": 64,
    "anchor_layers": 1,
    "anchor_heads": 2,
    "anchor_intermediate": 128,
    "anchor_batch": 4,
    "anchor_grad_accum": 2,
    "anchor_steps": 6,
    "anchor_log_every": 2,
    "anchor_learning_rate": 3e-3,
    # compiled only: the eager run differs by the compile flag alone (a process less)
    "anchor_modes": ("compiled",),
    "compile_backend": "eager",
    "direct_launch": True,
    "timeout": 300.0,
}


def make_plan(dry_run: bool, nproc: int, threads: int | None = None) -> Plan:
    sizes = DRY_RUN if dry_run else GPU
    cpus = len(os.sched_getaffinity(0))
    return Plan(dry_run=dry_run, nproc=nproc, threads=threads or max(1, cpus // nproc), **sizes)


def _validated(cfg: dict[str, Any]) -> dict[str, Any]:
    from kubellm.config import TrainConfig

    TrainConfig.model_validate(cfg)
    return cfg


def engine_config(
    plan: Plan, dataset: Path, output_dir: Path, strategy: str, steps: int, **extra: Any
) -> dict[str, Any]:
    """The TrainConfig JSON of one run of the tiny model (stages 2 and 3; validated here)."""
    cfg: dict[str, Any] = {
        "dataset_dir": str(dataset),
        "output_dir": str(output_dir),
        "steps": steps,
        "batch_size": plan.batch,
        "grad_accum_steps": plan.grad_accum,
        "learning_rate": plan.learning_rate,
        "warmup_steps": plan.warmup_steps,
        "log_every": plan.log_every,
        "eval_batches": plan.eval_batches,
        "save_model": True,
        "backend": plan.backend,
        "precision": plan.precision,
        "strategy": strategy,
        "seed": 0,
        "model": {
            "hidden_size": plan.hidden,
            "num_layers": plan.layers,
            "num_heads": plan.heads,
            "intermediate_size": plan.intermediate,
            "max_position_embeddings": max(128, plan.seq_len),
        },
    }
    cfg.update(extra)
    return _validated(cfg)


def anchor_config(plan: Plan, dataset: Path, output_dir: Path, compile: bool) -> dict[str, Any]:
    """The TrainConfig JSON of one anchor run (stage 4): one process, no export."""
    return _validated(
        {
            "dataset_dir": str(dataset),
            "output_dir": str(output_dir),
            "steps": plan.anchor_steps,
            "batch_size": plan.anchor_batch,
            "grad_accum_steps": plan.anchor_grad_accum,
            "learning_rate": plan.anchor_learning_rate,
            "warmup_steps": min(10, plan.anchor_steps // 2),
            "log_every": plan.anchor_log_every,
            "eval_batches": 1,
            "save_model": False,
            "backend": plan.backend,
            "precision": plan.precision,
            "compile": compile,
            "seed": 0,
            "model": {
                "hidden_size": plan.anchor_hidden,
                "num_layers": plan.anchor_layers,
                "num_heads": plan.anchor_heads,
                "intermediate_size": plan.anchor_intermediate,
                "max_position_embeddings": plan.anchor_seq_len,
            },
        }
    )


# --- running things ----------------------------------------------------------------------


@dataclasses.dataclass
class Proc:
    """One finished child command."""

    cmd: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    def tail(self, chars: int = 2500) -> str:
        return f"--- stdout\n{self.stdout[-chars:]}\n--- stderr\n{self.stderr[-chars:]}"

    def why(self) -> str:
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        return f"exit {self.rc}"


def child_env(
    plan: Plan, extra: Mapping[str, str] | None = None, distributed: bool = True
) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(plan.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # one GPU still gets a process group and the configured DDP / FSDP2 wrapping
    if distributed:
        env[FORCE_DISTRIBUTED_ENV] = "1"
    else:
        env.pop(FORCE_DISTRIBUTED_ENV, None)
    # the repository and its src/ first; the caller's entries (e.g. the bundle's site
    # folder, given relative to where it ran) made absolute: children run in REPO
    inherited = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(REPO), str(REPO / "src"), *inherited]))
    env.update(extra or {})
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float, log: Path | None = None) -> Proc:
    """Run `cmd` in its own process group (a timeout kills every rank), output captured."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc)
        out, err = proc.communicate()
    except BaseException:  # Ctrl-C: its own session does not get it; no ranks left on the GPUs
        _kill(proc)
        raise
    done = Proc(cmd, proc.returncode, out, err, time.perf_counter() - t0, timed_out)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(
            f"$ {shlex.join(cmd)}\n# {done.why()}, {done.seconds:.1f} s\n{done.tail(10**9)}"
        )
    return done


def _kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def torchrun(plan: Plan, *module_args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={plan.nproc}",
        "-m",
        *module_args,
    ]


def launch(plan: Plan, env: dict[str, str], *module_args: str, launcher: bool = False) -> list[str]:
    """`torchrun` around `-m module_args`; with `plan.direct_launch` and one process (the dry
    run) the rank itself, `env` given what torchrun would set, unless `launcher`."""
    if launcher or not plan.direct_launch or plan.nproc != 1:
        return torchrun(plan, *module_args)
    with socket.socket() as sock:  # a free port for the rendezvous (gloo's TCP store)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return [sys.executable, "-m", *module_args]


def worker(*args: str, deterministic: bool = False, backend: str = "") -> list[str]:
    """The module arguments of the `_train` worker: kubellm.train's main with patches."""
    cmd = ["bench.gpu_check", "_train", *args]
    if deterministic:
        cmd.append("--deterministic")
    if backend:
        cmd += ["--compile-backend", backend]
    return cmd


# --- reading the engine's output ---------------------------------------------------------


@dataclasses.dataclass
class EngineRun:
    """What one `kubellm.train` run printed, read back."""

    proc: Proc
    header: dict[str, str]  # the `train: params=... strategy=... ...` line
    steps: list[dict[str, float]]  # metric lines with a step, in order
    losses: dict[int, str]  # step -> loss exactly as printed
    final: dict[str, float]  # train_loss, eval_loss, perplexity (or stopped_at)
    resumed_at: int | None  # "resumed from ... at step N"

    @property
    def ok(self) -> bool:
        return self.proc.rc == 0 and not self.proc.timed_out


_RESUMED = re.compile(r"resumed from \S+ at step (\d+)")
# A metric line's step and loss as text: `loss=nan` too (parse_metrics drops non-finite values).
_STEP_LOSS = re.compile(r"(?:^|\s)step=(\d+)\s(?:.*\s)?loss=(\S+)")


def read_engine(proc: Proc) -> EngineRun:
    from kubellm.train.metric_lines import parse_metrics

    header: dict[str, str] = {}
    steps: list[dict[str, float]] = []
    losses: dict[int, str] = {}
    final: dict[str, float] = {}
    resumed_at = None
    for line in proc.stdout.splitlines():
        if line.startswith("train: params=") and not header:
            header = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
            continue
        if m := _RESUMED.search(line):
            resumed_at = int(m[1])
        if m := _STEP_LOSS.search(line):
            losses[int(m[1])] = m[2]
        metrics = parse_metrics(line)
        if "step" in metrics and "loss" in metrics:
            steps.append(metrics)
        elif "train_loss" in metrics:
            final.update(metrics)
    return EngineRun(proc, header, steps, losses, final, resumed_at)


def steady_rate(steps: list[dict[str, float]], tokens_per_step: int) -> float | None:
    """Tokens/s over the metric windows after the first (start-up and warm-up left out):
    all their tokens over all their seconds; the only window when there is one."""
    windows: list[tuple[int, float]] = []
    prev = 0
    for m in steps:
        step = int(m["step"])
        if "tokens_per_sec" in m and m["tokens_per_sec"] > 0 and step > prev:
            windows.append((step - prev, m["tokens_per_sec"]))
        prev = step
    use = windows[1:] or windows
    if not use:
        return None
    tokens = sum(n * tokens_per_step for n, _ in use)
    seconds = sum(n * tokens_per_step / rate for n, rate in use)
    return tokens / seconds


def mean_after_first(steps: list[dict[str, float]], name: str) -> float | None:
    values = [m[name] for m in steps if name in m]
    use = values[1:] or values
    return sum(use) / len(use) if use else None


# --- results -----------------------------------------------------------------------------


@dataclasses.dataclass
class Check:
    """One check inside a stage (a training run, an export, a resume)."""

    name: str
    ok: bool
    figures: str
    seconds: float
    problem: str = ""  # why it failed (one paragraph)
    log: str = ""  # the tail of the output, for the summary
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # figures, for summary.json

    def line(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        text = f"  {verdict}  {self.name:<12} {self.figures}; {self.seconds:.0f} s"
        if not self.ok and self.problem:
            text += f"\n        {self.problem}"
        return text


@dataclasses.dataclass
class Stage:
    """One stage's verdict: `figures` go to summary.json, `text` is its one-line summary."""

    name: str
    ok: bool
    figures: dict[str, Any]
    text: str
    checks: list[Check] = dataclasses.field(default_factory=list)
    problem: str = ""
    log: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        n = STAGE_ORDER.index(self.name) + 1 if self.name in STAGE_ORDER else 0
        text = f"{'PASS' if self.ok else 'FAIL'}  {n} {self.name:<9} {self.text}; "
        text += f"{self.seconds:.0f} s"
        if not self.ok and self.problem:
            text += f"\n      {self.problem}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": TITLES.get(self.name, ""),
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "summary": self.text,
            "figures": self.figures,
            "checks": [
                {
                    "name": c.name,
                    "ok": c.ok,
                    "seconds": round(c.seconds, 3),
                    "summary": c.figures,
                    "figures": c.data,
                    "problem": c.problem,
                }
                for c in self.checks
            ],
            "problem": self.problem,
            "log": self.log,
        }


def from_checks(name: str, checks: list[Check], figures: dict[str, Any], text: str) -> Stage:
    """A stage made of checks: it passes when every one did; the first failure says why."""
    bad = next((c for c in checks if not c.ok), None)
    return Stage(
        name,
        bad is None and bool(checks),
        figures,
        text,
        checks,
        f"{bad.name}: {bad.problem}" if bad else "",
        bad.log if bad else "",
    )


@dataclasses.dataclass
class Context:
    """What the stages share: the plan, the folders, and what earlier stages found."""

    plan: Plan
    work: Path  # scratch: exports, checkpoints, configs
    cache: Path  # datasets (kept between runs)
    logs: Path  # every child's output (under --out)
    min_busbw: float = 0.0
    matmul_flops: float | None = None  # stage 1: achieved FLOP/s
    sheet_peak: float | None = None  # stage 1: the peak table's entry, FLOP/s
    fsdp_export: Path | None = None  # stage 2's FSDP2 export, stage 3's pretrained model
    fsdp_eval_loss: float | None = None
    dataset: Path | None = None  # stage 2's
    vocab: int | None = None  # stage 2's tokenizer


# --- stage 1: versions, device, matmul ---------------------------------------------------


def time_matmul(n: int, warmup: int, iters: int, device: str) -> dict[str, Any]:
    """An n^3 matmul (bf16 on a GPU, float32 on the CPU): its mean time over `iters` after
    `warmup` (CUDA events), FLOP/s, and its error on 64 rows against float32."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    c = torch.mm(a, b)
    for _ in range(warmup):
        torch.mm(a, b, out=c)
    if device == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=c)
        seconds = (time.perf_counter() - t0) / iters
    ref = a[:64].float() @ b.float()
    err = float((c[:64].float() - ref).abs().max() / ref.abs().max())
    finite = bool(torch.isfinite(c).all())
    del a, b, c, ref
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "warmup": warmup,
        "iters": iters,
        "mean_ms": seconds * 1e3,
        "tflops": 2 * n**3 / seconds / 1e12,
        "max_rel_err": err,
        "finite": finite,
    }


def _nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    return None


def training_imports(fig: dict[str, Any]) -> str:
    """Import what the engine and prepare import at module level; "" or why they fail
    (on the GPU machine: the bundle is not on PYTHONPATH). Where pydantic came from goes to
    `fig`."""
    import importlib

    for name in ("pydantic", "zstandard", "kubellm.config", "kubellm.data.prepare"):
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            return (
                f"import {name} failed ({err}): on the GPU machine run `make gpu-bundle` here, "
                "carry .gpu-bundle and run with PYTHONPATH=src:.gpu-bundle/site"
            )
        if name == "pydantic":
            fig["pydantic"] = f"{module.VERSION} from {Path(module.__file__ or '').parent.parent}"
    return ""


def stage_versions(ctx: Context) -> Stage:
    import torch
    import transformers

    from kubellm.train import mfu

    plan = ctx.plan
    fig: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }
    # the engine's call (src/kubellm/train/model.py); older transformers name it
    # gradient_checkpointing_enable: stage 3 would fail there
    with contextlib.suppress(Exception):
        fig["transformers_has_activation_checkpointing_enable"] = hasattr(
            transformers.PreTrainedModel, "activation_checkpointing_enable"
        )
    missing = training_imports(fig)
    if missing:
        return Stage("versions", False, fig, "imports fail", problem=missing)
    if plan.device == "cuda":
        if not torch.cuda.is_available():
            return Stage(
                "versions",
                False,
                fig,
                "no GPU",
                problem=f"torch {torch.__version__} sees no GPU (CUDA build: "
                f"{torch.version.cuda or 'no, a CPU-only torch'}; CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); --dry-run runs the "
                "CPU version",
            )
        name = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        fig.update(
            cudnn=torch.backends.cudnn.version(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            driver=_nvidia_smi(),
            device=name,
            device_count=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=props.total_memory / 2**30,
        )
        key, peak = mfu.gpu_key(name), mfu.gpu_peak(name)
        if plan.nproc > fig["device_count"]:
            return Stage(
                "versions",
                False,
                fig,
                "too few GPUs",
                problem=f"--nproc {plan.nproc} but {fig['device_count']} GPU(s) visible",
            )
    else:
        fig.update(device=f"cpu ({len(os.sched_getaffinity(0))} threads)", driver=None)
        key, peak = "", None
    fig["peak_table_key"] = key or None
    fig["peak_table_tflops"] = peak / 1e12 if peak else None
    ctx.sheet_peak = peak
    mm = time_matmul(plan.matmul_n, plan.matmul_warmup, plan.matmul_iters, plan.device)
    mm["vs_peak_table"] = mm["tflops"] * 1e12 / peak if peak else None
    fig["matmul"] = mm
    ctx.matmul_flops = mm["tflops"] * 1e12
    tol = 2e-2 if plan.device == "cuda" else 1e-4
    problems = []
    if not mm["finite"] or not mm["max_rel_err"] <= tol:
        problems.append(
            f"the {mm['dtype']} matmul is wrong: max error {mm['max_rel_err']:.3g} of the "
            f"largest value against float32 (allowed {tol:g}), finite {mm['finite']}"
        )
    if not mm["tflops"] > 0:
        problems.append("the matmul took no time")
    table = (
        f"peak table {key!r}: {peak / 1e12:g} TFLOP/s"
        if peak
        else ("no peak table entry for a CPU" if plan.dry_run else f"{key!r} not in the table")
    )
    text = (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{transformers.__version__}, driver {fig['driver'] or 'n/a'}; {fig['device']}; "
        f"{table}; {mm['dtype']} {mm['n']}^3 matmul {mm['tflops']:.3g} TFLOP/s"
        + (f" ({mm['vs_peak_table']:.0%} of the table)" if peak else "")
    )
    return Stage("versions", not problems, fig, text, problem="; ".join(problems))


# --- stage 2: the tiny model -------------------------------------------------------------


def prepare(cache: Path, corpus_mb: float, vocab: int, seq_len: int) -> Path:
    from bench.train_bench import prepare_dataset

    return prepare_dataset(
        cache, num_records=0, vocab=vocab, seq_len=seq_len, seed=0, corpus_mb=corpus_mb
    )


def dataset_figures(dataset: Path, seconds: float) -> dict[str, Any]:
    manifest = json.loads((dataset / "manifest.json").read_text())
    return {
        "dir": str(dataset),
        "train_rows": manifest["rows"]["train"],
        "val_rows": manifest["rows"].get("val"),
        "vocab": int(manifest["tokenizer"].get("vocab_size", 0)) or None,
        "seq_len": manifest.get("seq_len"),
        "seconds": seconds,
    }


def logged_steps(steps: int, log_every: int) -> list[int]:
    """The steps the engine prints a metric line for."""
    return [s for s in range(1, steps + 1) if s % log_every == 0 or s == steps]


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def train_problems(
    r: EngineRun,
    strategy: str,
    output_dir: Path | None,
    expected: list[int],
    require_fall: bool = True,
) -> list[str]:
    """Why a training run does not count as a pass; [] when it does. `expected`: the steps
    that must have printed a loss; `output_dir` None: no export expected."""
    if not r.ok:
        return [f"kubellm.train failed ({r.proc.why()})"]
    problems = []
    got = r.header.get("strategy")
    if got != strategy:
        problems.append(
            f"the engine ran strategy={got!r}, not {strategy!r} (under torchrun it must apply "
            "the strategy even with one process)"
        )
    if sorted(r.losses) != expected:
        problems.append(f"losses printed for steps {sorted(r.losses)}, expected {expected}")
    bad = {s: v for s, v in r.losses.items() if not _finite(v)}
    losses = [float(r.losses[s]) for s in sorted(r.losses) if s not in bad]
    if bad or not losses:
        problems.append(f"training losses not all finite: {bad or 'none printed'}")
    elif require_fall and len(losses) > 1 and not losses[-1] < losses[0]:
        problems.append(f"the loss did not fall: {losses[0]:.4g} at first, {losses[-1]:.4g} last")
    eval_loss = r.final.get("eval_loss")
    if eval_loss is None or not math.isfinite(eval_loss):
        problems.append(f"no finite eval_loss printed ({r.final})")
    if output_dir is not None and not exported(output_dir):
        problems.append(f"no Hugging Face export in {output_dir}")
    return problems


def exported(output_dir: Path) -> bool:
    return (output_dir / "config.json").is_file() and any(output_dir.glob("*.safetensors"))


def train_figures(r: EngineRun, tokens_per_step: int) -> dict[str, Any]:
    """One engine run's figures: strategy, losses, tokens/s (steady windows), MFU, memory."""
    losses = [m["loss"] for m in r.steps]
    peak = max((m["peak_mem_gb"] for m in r.steps if "peak_mem_gb" in m), default=None)
    return {
        "strategy": r.header.get("strategy"),
        "precision": r.header.get("precision"),
        "params": int(r.header["params"]) if "params" in r.header else None,
        "trainable": int(r.header["trainable"]) if "trainable" in r.header else None,
        "steps": len(r.losses),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "eval_loss": r.final.get("eval_loss"),
        "tokens_per_s": steady_rate(r.steps, tokens_per_step),
        "engine_mfu": mean_after_first(r.steps, "mfu"),
        "peak_mem_gib": peak,
        "wall_s": r.proc.seconds,
    }


def _train_text(plan: Plan, d: Mapping[str, Any]) -> str:
    rate = d["tokens_per_s"]
    return (
        f"{plan.nproc} x {plan.device}, strategy {d['strategy'] or '?'}, "
        f"{d['precision'] or '?'}, loss {_f(d['loss_first'], '.3f')} -> "
        f"{_f(d['loss_last'], '.3f')}, eval_loss {_f(d['eval_loss'], '.3f')}, "
        f"{_f(rate, ',.0f')} tokens/s, MFU {_f(d['engine_mfu'], '.1%')}"
        + (f", peak GPU memory {_f(d['peak_mem_gib'], '.2f')} GiB" if not plan.dry_run else "")
    )


def check_train(
    plan: Plan,
    dataset: Path,
    work: Path,
    logs: Path,
    strategy: str,
    *,
    deterministic: bool = False,
    log_every: int | None = None,
) -> tuple[Check, EngineRun]:
    """`torchrun -m kubellm.train` of the tiny model, `plan.steps` steps, with an export.
    `deterministic`: through the `_train` worker with deterministic kernels (the straight
    run a resume is compared with; then log_every 1)."""
    out = work / f"{strategy}-model"
    shutil.rmtree(out, ignore_errors=True)  # a reused --work-dir
    every = log_every or plan.log_every
    cfg = engine_config(plan, dataset, out, strategy, plan.steps, log_every=every)
    config = work / f"{strategy}.json"
    config.write_text(json.dumps(cfg, indent=2))
    if deterministic:
        env = child_env(plan, DETERMINISTIC_ENV)
        cmd = launch(plan, env, *worker("--config", str(config), deterministic=True))
    else:  # always torchrun: the dry run, too, runs the command line of the GPU
        env = child_env(plan)
        cmd = launch(plan, env, "kubellm.train", "--config", str(config), launcher=True)
    proc = run(cmd, env, plan.timeout, logs / f"{strategy}.log")
    r = read_engine(proc)
    problems = train_problems(r, strategy, out, logged_steps(plan.steps, every))
    data = train_figures(r, plan.batch * plan.seq_len)
    check = Check(
        strategy,
        not problems,
        _train_text(plan, data),
        proc.seconds,
        "; ".join(problems),
        "" if not problems else proc.tail(),
        data,
    )
    return check, r


def generate_exports(
    plan: Plan, dataset: Path, dirs: list[Path], logs: Path
) -> dict[str, dict[str, Any]]:
    """Load each exported directory in a fresh process and generate; dir -> its result."""
    cmd = [sys.executable, "-m", "bench.gpu_check", "_generate", "--device", plan.device]
    cmd += ["--dataset", str(dataset), "--world", str(plan.nproc)]
    cmd += ["--micro-batch", str(plan.micro_batch), "--eval-batches", str(plan.eval_batches)]
    cmd += ["--new-tokens", str(plan.new_tokens), *map(str, dirs)]
    proc = run(cmd, child_env(plan), plan.timeout, logs / "generate.log")
    found: dict[str, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith(GENERATE_PREFIX):
            got = json.loads(line[len(GENERATE_PREFIX) :])
            found[got["dir"]] = got
    for d in dirs:
        found.setdefault(
            str(d),
            {
                "dir": str(d),
                "error": f"no result: the generate process failed ({proc.why()})",
                "log": proc.tail(),
            },
        )
    return found


def export_check(
    plan: Plan, strategy: str, trained: EngineRun | None, result: dict[str, Any] | None
) -> Check:
    name = f"export-{strategy}"
    if trained is None or result is None:
        return Check(name, False, "not run", 0.0, f"no export: the {strategy} run failed")
    if "error" in result:
        return Check(
            name,
            False,
            "no figures",
            result.get("seconds", 0.0),
            result["error"],
            result.get("log", ""),
        )
    problems = []
    eval_loss = trained.final.get("eval_loss", math.nan)
    loss = result["loss"]
    if not math.isfinite(loss) or not math.isclose(loss, eval_loss, rel_tol=plan.loss_rtol):
        problems.append(
            f"the exported model's loss on the engine's validation rows is {loss:.6g}, the "
            f"engine's eval_loss {eval_loss:.6g} (more than {plan.loss_rtol:.1%} apart: the "
            "export is not the trained model, or the engine evaluates other rows now)"
        )
    if result["new_tokens"] != plan.new_tokens:
        problems.append(f"generated {result['new_tokens']} tokens, not {plan.new_tokens}")
    if not result.get("finite", False):
        problems.append("non-finite logits")
    figures = (
        f"loaded on {result['device']}, val loss {loss:.4f} vs engine eval_loss "
        f"{eval_loss:.4f}, generated {result['new_tokens']} tokens: {result['text']!r}"
    )
    data = {
        "device": result["device"],
        "val_loss": loss,
        "engine_eval_loss": eval_loss,
        "new_tokens": result["new_tokens"],
        "text": result["text"],
    }
    return Check(name, not problems, figures, result["seconds"], "; ".join(problems), "", data)


def load_weights(output_dir: Path) -> dict[str, Any]:
    """Every tensor of an exported directory (all its safetensors files)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(output_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def compare_resume(
    straight: dict[int, str],
    first: dict[int, str],
    second: dict[int, str],
    stop: int,
    steps: int,
    weights_a: Mapping[str, Any],
    weights_b: Mapping[str, Any],
    resumed_at: int | None,
) -> list[str]:
    """Why a stop-and-resume is not bit-exact against the straight run; [] when it is.

    straight / first / second: step -> loss as printed (the straight run, the run that
    stopped after `stop`, the run that resumed); weights: the two exports' tensors.
    """
    import torch

    problems = []
    bad = {s: v for run in (straight, first, second) for s, v in run.items() if not _finite(v)}
    if bad:
        problems.append(f"non-finite losses {bad}: nothing to compare")
    if sorted(straight) != list(range(1, steps + 1)):
        problems.append(f"the straight run printed losses for steps {sorted(straight)}")
    if resumed_at != stop:
        problems.append(f"the second run did not resume at step {stop} (resumed at {resumed_at})")
    if sorted(first) != list(range(1, stop + 1)):
        problems.append(f"the first run printed losses for steps {sorted(first)}, not 1-{stop}")
    if sorted(second) != list(range(stop + 1, steps + 1)):
        problems.append(
            f"the resumed run printed losses for steps {sorted(second)}, not {stop + 1}-{steps}"
        )
    before = [s for s in sorted(first) if s in straight and first[s] != straight[s]]
    if before:
        s = before[0]
        problems.append(
            f"the runs differ before the checkpoint, at step {s} (loss {straight[s]} straight, "
            f"{first[s]} in the first half): the kernels are not deterministic here, which is "
            "not a checkpoint bug"
        )
    after = [s for s in sorted(second) if s in straight and second[s] != straight[s]]
    if after:
        s = after[0]
        problems.append(
            f"after resuming at step {stop} the loss differs from step {s} on ({straight[s]} "
            f"straight, {second[s]} resumed; {len(after)} of {len(second)} steps differ)"
        )
    if weights_a.keys() != weights_b.keys():
        only = sorted(set(weights_a) ^ set(weights_b))[:5]
        problems.append(f"the exports hold different tensors (e.g. {only})")
    else:
        differ = []
        for k in sorted(weights_a):
            a, b = weights_a[k], weights_b[k]
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                diff = (
                    float((a.float() - b.float()).abs().max()) if a.shape == b.shape else math.inf
                )
                differ.append(f"{k} (max |diff| {diff:.3g})")
        if differ:
            problems.append(
                f"{len(differ)} of {len(weights_a)} exported tensors differ: "
                + ", ".join(differ[:3])
            )
    if not weights_a:
        problems.append("the exports hold no tensors")
    return problems


def check_resume(
    plan: Plan,
    dataset: Path,
    work: Path,
    logs: Path,
    strategy: str,
    straight: EngineRun,
    straight_out: Path,
) -> Check:
    """`plan.stop` steps + stop_after (a DCP checkpoint), then a run resuming from it to
    `plan.steps`, against `straight` (the same config run straight through, deterministic)."""
    name = f"resume-{strategy}"
    steps, stop = plan.steps, plan.stop
    ckpt = work / f"{name}-ckpt"
    resumed_out = work / f"{name}-model"
    for stale in (ckpt, resumed_out):  # a reused --work-dir
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()

    def engine(tag: str, **extra: Any) -> EngineRun:
        cfg = engine_config(plan, dataset, resumed_out, strategy, steps, log_every=1, **extra)
        config = work / f"{name}-{tag}.json"
        config.write_text(json.dumps(cfg, indent=2))
        env = child_env(plan, DETERMINISTIC_ENV)
        cmd = launch(plan, env, *worker("--config", str(config), deterministic=True))
        return read_engine(run(cmd, env, plan.timeout, logs / f"{name}-{tag}.log"))

    first = engine("first", checkpoint_dir=str(ckpt), stop_after=stop)
    if not first.ok:
        return _failed_run(name, f"the run stopping after step {stop}", first, t0)
    second = engine("second", checkpoint_dir=str(ckpt))
    if not second.ok:
        return _failed_run(name, "the resumed run", second, t0)
    if not exported(straight_out) or not exported(resumed_out):
        return Check(name, False, "no export", time.perf_counter() - t0, "an export is missing")
    a = load_weights(straight_out)
    b = load_weights(resumed_out)
    problems = compare_resume(
        straight.losses, first.losses, second.losses, stop, steps, a, b, second.resumed_at
    )
    final_a = straight.final.get("train_loss")
    final_b = second.final.get("train_loss")
    if final_a != final_b:
        problems.append(f"final train_loss {final_a} straight, {final_b} resumed")
    if problems and strategy == "ddp" and plan.nproc > 2:
        problems.append(
            "(DDP with more than 2 ranks: DDP rebuilds its gradient buckets after each "
            "process's first step, so the first step after a resume all-reduces in another "
            "layout, and NCCL's summation order follows the layout)"
        )
    figures = (
        f"{steps} steps straight vs {stop} + stop_after (DCP checkpoint) + resume to {steps} "
        f"({strategy}, {plan.nproc} process(es), deterministic kernels): "
        + (
            f"{len(straight.losses)} step losses, final loss {_f(final_a, '.6g')} and "
            f"{len(a)} exported tensors bit-identical"
            if not problems
            else "differences found"
        )
    )
    data = {
        "steps": steps,
        "checkpoint_at": stop,
        "resumed_at": second.resumed_at,
        "bit_exact": not problems,
        "losses_compared": len(straight.losses),
        "tensors_compared": len(a),
        "final_train_loss": final_a,
    }
    return Check(
        name, not problems, figures, time.perf_counter() - t0, "; ".join(problems), "", data
    )


def _failed_run(name: str, which: str, r: EngineRun, t0: float) -> Check:
    return Check(
        name,
        False,
        "not compared",
        time.perf_counter() - t0,
        f"{which} failed ({r.proc.why()})",
        r.proc.tail(),
    )


def stage_tiny(ctx: Context) -> Stage:
    plan, work, logs = ctx.plan, ctx.work, ctx.logs
    checks: list[Check] = []
    fig: dict[str, Any] = {}

    def add(check: Check) -> bool:
        checks.append(check)
        print(check.line(), flush=True)
        return check.ok

    def done() -> Stage:
        by = {c.name: c for c in checks}
        resume = by.get("resume-fsdp")
        text = (
            f"ddp {_f(fig.get('ddp', {}).get('tokens_per_s'), ',.0f')} and fsdp "
            f"{_f(fig.get('fsdp', {}).get('tokens_per_s'), ',.0f')} tokens/s, resume "
            + ("bit-exact" if resume and resume.ok else "not bit-exact" if resume else "not run")
            + f", {sum(c.ok for c in checks if c.name.startswith('export-'))}/2 exports "
            "reloaded and generating"
        )
        return from_checks("tiny", checks, fig, text)

    t0 = time.perf_counter()
    try:
        dataset = prepare(ctx.cache, plan.corpus_mb, plan.vocab, plan.seq_len)
    except Exception as err:  # the data cannot be made: say why
        add(Check("dataset", False, "not prepared", time.perf_counter() - t0, repr(err)))
        return done()
    fig["dataset"] = dataset_figures(dataset, time.perf_counter() - t0)
    ctx.vocab = fig["dataset"]["vocab"] or plan.vocab
    fig["model_params"] = meta_model(
        plan.hidden, plan.layers, plan.heads, plan.intermediate, plan.seq_len, ctx.vocab
    )[0]
    ddp_check, ddp = check_train(plan, dataset, work, logs, "ddp")
    fig["ddp"] = ddp_check.data
    if not add(ddp_check):
        return done()
    # the straight run of the resume check: deterministic kernels, every step's loss
    fsdp_check, fsdp = check_train(
        plan, dataset, work, logs, "fsdp", deterministic=True, log_every=1
    )
    fig["fsdp"] = fsdp_check.data
    if not add(fsdp_check):
        return done()
    resume = check_resume(plan, dataset, work, logs, "fsdp", fsdp, work / "fsdp-model")
    fig["resume_fsdp"] = resume.data
    if not add(resume):
        return done()
    dirs = {s: work / f"{s}-model" for s in ("ddp", "fsdp")}
    results = generate_exports(plan, dataset, list(dirs.values()), logs)
    for strategy, trained in (("ddp", ddp), ("fsdp", fsdp)):
        check = export_check(plan, strategy, trained, results.get(str(dirs[strategy])))
        fig[f"export_{strategy}"] = check.data
        if not add(check):
            return done()
    ctx.dataset, ctx.fsdp_export = dataset, dirs["fsdp"]
    ctx.fsdp_eval_loss = fsdp.final.get("eval_loss")
    return done()


# --- stage 3: FSDP2 + LoRA + compile + activation checkpointing ---------------------------


def lora_problems(
    r: EngineRun, pretrained_eval: float, vocab: int, output_dir: Path, steps: int
) -> list[str]:
    """Why the LoRA run (from the pretrained export) does not pass; [] when it does."""
    problems = train_problems(r, "fsdp", output_dir, logged_steps(steps, 1), require_fall=False)
    if not r.ok:
        return problems
    params, trainable = int(r.header.get("params", 0)), int(r.header.get("trainable", 0))
    if not 0 < trainable < params:
        problems.append(f"trainable {trainable} of {params} parameters: LoRA trains only adapters")
    eval_loss = r.final.get("eval_loss", math.nan)
    fresh = math.log(vocab)  # a new model's loss: uniform over the vocabulary
    if not abs(eval_loss - pretrained_eval) < abs(eval_loss - fresh):
        problems.append(
            f"eval_loss {eval_loss:.4g} is nearer a new model's ln(vocab) {fresh:.4g} than the "
            f"pretrained export's {pretrained_eval:.4g}: the weights did not arrive"
        )
    return problems


def stage_lora(ctx: Context) -> Stage:
    plan = ctx.plan
    dataset, export, pretrained_eval, vocab = (
        ctx.dataset,
        ctx.fsdp_export,
        ctx.fsdp_eval_loss,
        ctx.vocab,
    )
    if dataset is None or export is None or pretrained_eval is None or vocab is None:
        return Stage("lora", False, {}, "not run", problem="needs stage 2 (tiny)'s FSDP2 export")
    out = ctx.work / "lora-model"
    shutil.rmtree(out, ignore_errors=True)
    lora = {"r": plan.lora_rank, "alpha": 2 * plan.lora_rank}
    cfg = engine_config(
        plan,
        dataset,
        out,
        "fsdp",
        plan.lora_steps,
        log_every=1,
        model_name_or_path=str(export),
        lora=lora,
        compile=True,
        activation_checkpointing=True,
    )
    config = ctx.work / "lora.json"
    config.write_text(json.dumps(cfg, indent=2))
    env = child_env(plan)
    cmd = launch(plan, env, *worker("--config", str(config), backend=plan.compile_backend))
    proc = run(cmd, env, plan.timeout, ctx.logs / "lora.log")
    r = read_engine(proc)
    problems = lora_problems(r, pretrained_eval, vocab, out, plan.lora_steps)
    fig = train_figures(r, plan.batch * plan.seq_len)
    fig.update(
        pretrained=str(export),
        pretrained_eval_loss=pretrained_eval,
        fresh_model_loss=math.log(vocab),
        lora=lora,
        compile_backend=plan.compile_backend or "inductor",
        activation_checkpointing=True,
        exported=exported(out),
    )
    text = (
        f"strategy {fig['strategy'] or '?'}, {_f(fig['trainable'], ',')} of "
        f"{_f(fig['params'], ',')} parameters train (LoRA r {plan.lora_rank}), compile "
        f"({fig['compile_backend']}) + activation checkpointing, eval_loss "
        f"{_f(fig['eval_loss'], '.3f')} (pretrained {pretrained_eval:.3f}, a new model "
        f"{math.log(vocab):.3f}), {_f(fig['tokens_per_s'], ',.0f')} tokens/s"
        + (f", peak GPU memory {_f(fig['peak_mem_gib'], '.2f')} GiB" if not plan.dry_run else "")
    )
    return Stage(
        "lora",
        not problems,
        fig,
        text,
        problem="; ".join(problems),
        log=proc.tail() if problems else "",
    )


# --- stage 4: the throughput anchor --------------------------------------------------------


def meta_model(
    hidden: int, layers: int, heads: int, intermediate: int, seq_len: int, vocab: int
) -> tuple[int, float, int]:
    """(parameters, training FLOPs per token, matmul weights) of the engine's from-config
    Llama of that shape, built on the meta device."""
    import torch

    from bench.train_bench import _Vocab
    from kubellm.config import ModelConfig
    from kubellm.train import mfu
    from kubellm.train.model import new_llama

    cfg = ModelConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=max(128, seq_len),
    )
    with torch.device("meta"):
        model = new_llama(cfg, _Vocab(vocab))  # type: ignore[arg-type]
    trainable, frozen = mfu.matmul_params(model)
    params = sum(p.numel() for p in model.parameters())
    return params, mfu.model_flops_per_token(model, seq_len), trainable + frozen


def anchor_run(
    plan: Plan, dataset: Path, ctx: Context, mode: str, fpt: float
) -> tuple[Check, dict[str, Any]]:
    out = ctx.work / f"anchor-{mode}"
    compiled = mode == "compiled"
    cfg = anchor_config(plan, dataset, out, compile=compiled)
    config = ctx.work / f"anchor-{mode}.json"
    config.write_text(json.dumps(cfg, indent=2))
    backend = plan.compile_backend if compiled else ""
    cmd = [sys.executable, "-m", *worker("--config", str(config), backend=backend)]
    proc = run(
        cmd, child_env(plan, distributed=False), plan.timeout, ctx.logs / f"anchor-{mode}.log"
    )
    r = read_engine(proc)
    expected = logged_steps(plan.anchor_steps, plan.anchor_log_every)
    problems = train_problems(r, "single", None, expected)
    d = train_figures(r, plan.anchor_batch * plan.anchor_seq_len)
    rate = d["tokens_per_s"]
    if r.ok and not rate:
        problems.append("no tokens/s printed")
    d["mfu_vs_peak_table"] = rate * fpt / ctx.sheet_peak if rate and ctx.sheet_peak else None
    d["mfu_vs_matmul"] = rate * fpt / ctx.matmul_flops if rate and ctx.matmul_flops else None
    d["compile_backend"] = (plan.compile_backend or "inductor") if compiled else None
    text = (
        f"{_f(rate, ',.0f')} tokens/s, MFU {_f(d['mfu_vs_peak_table'], '.1%')} of the table, "
        f"{_f(d['mfu_vs_matmul'], '.1%')} of the matmul"
        + (f", peak memory {_f(d['peak_mem_gib'], '.2f')} GiB" if not plan.dry_run else "")
        + f", {proc.seconds:.0f} s wall"
    )
    check = Check(
        mode,
        not problems,
        text,
        proc.seconds,
        "; ".join(problems),
        "" if not problems else proc.tail(),
        d,
    )
    return check, d


def stage_anchor(ctx: Context) -> Stage:
    plan = ctx.plan
    checks: list[Check] = []
    fig: dict[str, Any] = {"anchors": list(ANCHORS)}
    t0 = time.perf_counter()
    dataset = prepare(ctx.cache, plan.corpus_mb, plan.anchor_vocab, plan.anchor_seq_len)
    fig["dataset"] = dataset_figures(dataset, time.perf_counter() - t0)
    vocab = fig["dataset"]["vocab"] or plan.anchor_vocab
    params, fpt, matmul = meta_model(
        plan.anchor_hidden,
        plan.anchor_layers,
        plan.anchor_heads,
        plan.anchor_intermediate,
        plan.anchor_seq_len,
        vocab,
    )
    fig["model"] = {
        "hidden": plan.anchor_hidden,
        "layers": plan.anchor_layers,
        "heads": plan.anchor_heads,
        "intermediate": plan.anchor_intermediate,
        "seq_len": plan.anchor_seq_len,
        "vocab": vocab,
        "params": params,
        "matmul_weights": matmul,
        "flops_per_token": fpt,
        "batch": plan.anchor_batch,
        "grad_accum": plan.anchor_grad_accum,
        "steps": plan.anchor_steps,
        "log_every": plan.anchor_log_every,
        "precision": plan.precision,
    }
    fig["peak_table_tflops"] = ctx.sheet_peak / 1e12 if ctx.sheet_peak else None
    fig["matmul_tflops"] = ctx.matmul_flops / 1e12 if ctx.matmul_flops else None
    for mode in plan.anchor_modes:
        check, d = anchor_run(plan, dataset, ctx, mode, fpt)
        fig[mode] = d
        checks.append(check)
        print(check.line(), flush=True)
        if not check.ok:
            break
    eager, comp = fig.get("eager", {}), fig.get("compiled", {})
    if eager.get("tokens_per_s") and comp.get("tokens_per_s"):
        fig["compile_speedup"] = comp["tokens_per_s"] / eager["tokens_per_s"]
    for mode in ("eager", "compiled"):
        if mode not in plan.anchor_modes:
            fig.setdefault("skipped", {})[mode] = "dry run: it differs by the compile flag alone"
    runs = ", ".join(
        f"{mode} {_f(fig[mode].get('tokens_per_s'), ',.0f')} tokens/s (MFU "
        f"{_f(fig[mode].get('mfu_vs_peak_table'), '.1%')} of the table, "
        f"{_f(fig[mode].get('mfu_vs_matmul'), '.1%')} of the matmul)"
        for mode in ("eager", "compiled")
        if mode in fig
    )
    text = f"{params / 1e6:.1f}M params, seq {plan.anchor_seq_len}: {runs or 'no run'}"
    return from_checks("anchor", checks, fig, text)


# --- stage 5: fabric ---------------------------------------------------------------------


def check_fabric(plan: Plan, logs: Path, min_busbw: float) -> Check:
    from kubellm.train.metric_lines import parse_metrics

    args = ["kubellm.train.fabric"]
    if min_busbw:
        args += ["--min-busbw-gbps", str(min_busbw)]
    env = child_env(plan)
    proc = run(launch(plan, env, *args), env, plan.timeout, logs / "fabric.log")
    m = parse_metrics(proc.stdout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("fabric: ")), "")
    fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
    data: dict[str, Any] = {
        k: m.get(k)
        for k in ("allreduce_busbw_gbps", "allreduce_algbw_gbps", "allreduce_ms", "allreduce_mib")
    }
    data.update(
        world_size=int(m.get("world_size", plan.nproc)),
        backend=fields.get("backend"),
        transport=fields.get("transport"),
    )
    if "allreduce_busbw_gbps" in m:
        figures = (
            f"busbw {m['allreduce_busbw_gbps']:.2f} GB/s (algbw "
            f"{m.get('allreduce_algbw_gbps', math.nan):.2f} GB/s, "
            f"{m.get('allreduce_ms', math.nan):.3f} ms per {m.get('allreduce_mib', 0):g} MiB "
            f"all-reduce, {data['world_size']} rank(s), "
            f"{fields.get('backend', '?')}, transport {fields.get('transport', '?')})"
        )
        if data["world_size"] == 1:
            figures += "; one rank: a loopback all-reduce, busbw 0 by definition"
    else:
        figures = "no all-reduce figures printed"
    ok = proc.rc == 0 and not proc.timed_out and "allreduce_busbw_gbps" in m
    problem = "" if ok else f"kubellm.train.fabric failed ({proc.why()})"
    return Check("fabric", ok, figures, proc.seconds, problem, "" if ok else proc.tail(), data)


def stage_fabric(ctx: Context) -> Stage:
    check = check_fabric(ctx.plan, ctx.logs, ctx.min_busbw)
    return Stage("fabric", check.ok, check.data, check.figures, [], check.problem, check.log)


STAGES: dict[str, Callable[[Context], Stage]] = {
    "versions": stage_versions,
    "tiny": stage_tiny,
    "lora": stage_lora,
    "anchor": stage_anchor,
    "fabric": stage_fabric,
}


def run_stage(name: str, ctx: Context) -> Stage:
    """One stage, timed; an exception is its failure (with the traceback), never the run's."""
    t0 = time.perf_counter()
    try:
        stage = STAGES[name](ctx)
    except Exception as err:
        stage = Stage(
            name,
            False,
            {},
            "exception",
            problem=f"{type(err).__name__}: {err}",
            log=traceback.format_exc()[-4000:],
        )
    stage.seconds = time.perf_counter() - t0
    return stage


# --- the summary -------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    """summary.json and the markdown summary, rewritten after every stage."""

    out_dir: Path
    md: Path
    command: str
    dry_run: bool
    wanted: list[str]
    budget_s: float
    started: float = dataclasses.field(default_factory=time.perf_counter)
    stages: list[Stage] = dataclasses.field(default_factory=list)
    plan: Plan | None = None
    machine: dict[str, str] = dataclasses.field(default_factory=dict)
    error: str = ""  # an exception outside any stage, or an interruption
    finished: bool = False

    @property
    def passed(self) -> bool:
        ran = [s.name for s in self.stages]
        return not self.error and ran == self.wanted and all(s.ok for s in self.stages)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def data(self) -> dict[str, Any]:
        failed = next((s.name for s in self.stages if not s.ok), None)
        ran = {s.name for s in self.stages}
        status = "passed" if self.passed else "failed" if self.finished else "running"
        return {
            "status": status,
            "passed": self.passed,
            "failed_stage": failed,
            "error": self.error,
            "dry_run": self.dry_run,
            "command": self.command,
            "seconds": round(self.seconds, 3),
            "budget_s": self.budget_s,
            "within_budget": self.seconds < self.budget_s,
            "stages": [s.to_json() for s in self.stages],
            "not_run": [n for n in self.wanted if n not in ran],
            "plan": dataclasses.asdict(self.plan) if self.plan else None,
            "machine": self.machine,
        }

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = self.data()
        _write(self.out_dir / "summary.json", json.dumps(data, indent=2, default=str) + "\n")
        _write(self.md, markdown(data))


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def markdown(d: Mapping[str, Any]) -> str:
    verdict = {"passed": "PASS", "failed": "FAIL", "running": "RUNNING"}[d["status"]]
    where = "dry run on the CPU" if d["dry_run"] else "GPU"
    rows = "\n".join(
        f"| {i} {s['name']} | {'PASS' if s['ok'] else '**FAIL**'} | {s['seconds']:.0f} | "
        f"{_cell(s['summary'])} |"
        for i, s in ((STAGE_ORDER.index(s["name"]) + 1, s) for s in d["stages"])
    )
    not_run = "\n".join(f"| {STAGE_ORDER.index(n) + 1} {n} | not run | | |" for n in d["not_run"])
    details = []
    for s in d["stages"]:
        lines = [f"### {STAGE_ORDER.index(s['name']) + 1}. {s['title']}", "", s["summary"], ""]
        lines += [
            f"- {c['name']}: {'PASS' if c['ok'] else '**FAIL**'}, {c['summary']} "
            f"({c['seconds']:.0f} s)" + (f". {c['problem']}" if c["problem"] else "")
            for c in s["checks"]
        ]
        if not s["ok"]:
            lines += ["", f"**Failed**: {s['problem']}"]
            if s["log"]:
                lines += ["", "```", s["log"].strip(), "```"]
        details.append("\n".join(lines).rstrip() + "\n")
    machine = "\n".join(f"| {k} | {v} |" for k, v in d["machine"].items())
    error = f"\n**Stopped**: {d['error']}\n" if d["error"] else ""
    budget = (
        f"{d['seconds']:.0f} s in all ({'within' if d['within_budget'] else '**over**'} the "
        f"{d['budget_s']:.0f} s budget)"
    )
    return f"""# gpu-check: {verdict} ({where})

{d["machine"].get("date", "")}; {budget}; fail-fast: the first failing stage ends the run.

```
{d["command"]}
```

| stage | result | seconds | figures |
|---|---|---:|---|
{rows}
{not_run}
{error}
{chr(10).join(details)}

MFU anchors (stage 4): {"; ".join(ANCHORS)}. Stage 4's MFU is the PaLM FLOPs per token
(kubellm.train.mfu) x synced tokens/s over the peak table's dense bf16 figure, and over stage
1's measured matmul. Not proven by any stage: {NOT_PROVEN}

## Machine

| | |
|---|---|
{machine}
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _f(x: float | int | None, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, spec)


def _machine(dry_run: bool) -> dict[str, str]:
    from bench.machine import machine_info

    info = machine_info(("torch", "transformers", "pydantic"))
    info["gpu"] = "none"
    if not dry_run:
        import torch

        with contextlib.suppress(Exception):
            info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
            info["cuda"] = str(torch.version.cuda)
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


# --- main --------------------------------------------------------------------------------


def out_paths(out: str) -> tuple[Path, Path]:
    """(the out folder, the markdown file): `DIR` -> DIR/summary.md; `DIR/NAME.md` -> that
    file, summary.json beside it."""
    path = Path(out)
    if path.suffix == ".md":
        return path.parent, path
    return path, path / "summary.md"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="the same stages on the CPU: gloo, tiny sizes"
    )
    ap.add_argument("--nproc", type=int, help="processes of stages 2, 3, 5 (default: every GPU; 1)")
    ap.add_argument(
        "--stages",
        default=",".join(STAGE_ORDER),
        help=f"comma-separated subset of {','.join(STAGE_ORDER)} (lora needs tiny)",
    )
    ap.add_argument("--out", default="runs/gpu-check", help="folder for summary.json + .md")
    ap.add_argument("--cache-dir", default="runs/bench", help="dataset cache")
    ap.add_argument("--work-dir", default="", help="scratch (default: a new dir in cache-dir)")
    ap.add_argument("--keep", action="store_true", help="keep the exports and checkpoints")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS per process")
    ap.add_argument("--min-busbw-gbps", type=float, default=0.0, help="fabric threshold")
    ap.add_argument(
        "--budget-s", type=float, help="the time the run should take (default 420; dry run 120)"
    )
    args = ap.parse_args(argv)
    unknown = set(args.stages.split(",")) - set(STAGE_ORDER)
    if unknown:
        ap.error(f"unknown stages {sorted(unknown)}; allowed: {', '.join(STAGE_ORDER)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_train"]:
        return train_worker(argv[1:])
    if argv[:1] == ["_generate"]:
        return generate_worker(argv[1:])
    args = parse_args(argv)
    out_dir, md = out_paths(args.out)
    wanted = [s for s in STAGE_ORDER if s in args.stages.split(",")]
    report = Report(
        out_dir,
        md,
        shlex.join(["python", "bench/gpu_check.py", *argv]),
        args.dry_run,
        wanted,
        args.budget_s or (120.0 if args.dry_run else 420.0),
    )
    report.write()  # a summary.json exists from the start
    work: Path | None = None
    try:
        with contextlib.suppress(Exception):
            report.machine = _machine(args.dry_run)
        nproc = args.nproc or (1 if args.dry_run else _gpus() or 1)
        plan = make_plan(args.dry_run, nproc, args.threads)
        report.plan = plan
        cache = Path(args.cache_dir).resolve()
        cache.mkdir(parents=True, exist_ok=True)
        work = (
            Path(args.work_dir).resolve()
            if args.work_dir
            else Path(tempfile.mkdtemp(dir=cache, prefix="gpu-check-"))
        )
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(plan, work, cache, out_dir.resolve() / "logs", args.min_busbw_gbps)
        print(
            f"gpu-check: {'dry run, CPU' if plan.dry_run else 'GPU'}, {plan.nproc} process(es) "
            f"({plan.backend}, {plan.precision}), stages {', '.join(wanted)}; scratch {work}",
            flush=True,
        )
        for name in wanted:
            stage = run_stage(name, ctx)
            report.stages.append(stage)
            report.write()
            print(stage.line(), flush=True)
            if not stage.ok:
                break
    except BaseException as err:  # outside a stage, or Ctrl-C: still a summary
        report.error = f"{type(err).__name__}: {err}"
        if not isinstance(err, Exception):
            raise
        traceback.print_exc()
    finally:
        report.finished = True
        report.write()
        if work is not None and not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"gpu-check: {'PASS' if report.passed else 'FAIL'} "
        f"({sum(s.ok for s in report.stages)}/{len(wanted)} stages passed, "
        f"{report.seconds:.0f} s); summary {out_dir / 'summary.json'}, {md}",
        flush=True,
    )
    return 0 if report.passed else 1


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- the workers: run inside torchrun / a fresh process ----------------------------------


def train_worker(argv: list[str]) -> int:
    """`kubellm.train`'s own entry point, with what a check needs first: deterministic
    kernels, another torch.compile backend."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check _train")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--compile-backend", default="")
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    import torch

    if args.deterministic:
        # warn_only: an op without a deterministic kernel warns (the comparison then shows
        # it) rather than failing the run. Flash / memory-efficient attention's backward is
        # not deterministic under warn_only: the math kernel is.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        if torch.cuda.is_available():
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
            torch.backends.cuda.enable_math_sdp(True)
    if args.compile_backend:
        # nn.Module.compile (the engine's per-layer compile) calls torch.compile
        import functools

        compile_with = functools.partial(torch.compile, backend=args.compile_backend)
        torch.compile = compile_with  # type: ignore[assignment]
    from kubellm.process import exit_now
    from kubellm.train import loop

    exit_now(loop.main(["--config", args.config]))
    return 0  # not reached


def eval_rows(n: int, world: int, micro_batch: int, eval_batches: int) -> list[range]:
    """The validation rows the engine's `evaluate` reads, one range per (batch, rank)
    forward, as kubellm/train/loop.py picks them: `size` rows each, the same count per rank."""
    size = max(1, min(micro_batch, n // world))
    batches = max(1, min(eval_batches, n // (size * world)))
    out = []
    for b in range(batches):
        for rank in range(world):
            first = ((b * world + rank) * size) % max(1, n - size + 1)
            out.append(range(first, first + size))
    return out


def generate_worker(argv: list[str]) -> int:
    """Load each exported directory, measure its validation loss, generate a few tokens."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check _generate")
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--eval-batches", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kubellm.data.artifact import load_split

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    val = load_split(args.dataset, "val").long()
    chunks = eval_rows(int(val.shape[1]), args.world, args.micro_batch, args.eval_batches)
    bf16 = device.type == "cuda"
    for d in args.dirs:
        t0 = time.perf_counter()
        result: dict[str, Any] = {"dir": d, "device": str(device)}
        try:
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
            model.to(device)  # type: ignore[arg-type]  # transformers types .to oddly
            tok = AutoTokenizer.from_pretrained(d)
            model.eval()
            losses = []
            with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                for rows in chunks:
                    x, y = val[:, rows.start : rows.stop].to(device)
                    losses.append(float(model(input_ids=x, labels=y).loss))
                prompt = val[0, :1, :16].to(device)
                logits = model(input_ids=prompt).logits
                out = model.generate(
                    input_ids=prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                )
            new = out[0, prompt.shape[1] :]
            result.update(
                loss=sum(losses) / len(losses),
                finite=bool(torch.isfinite(logits).all()),
                new_tokens=int(new.numel()),
                prompt=tok.decode(prompt[0]),
                text=tok.decode(new),
            )
        except Exception as err:  # reported as the check's failure, per directory
            result["error"] = f"{type(err).__name__}: {err}"
        result["seconds"] = time.perf_counter() - t0
        print(GENERATE_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
