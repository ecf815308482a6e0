"""Is this GPU node fit to train on? One command, every GPU, a PASS/FAIL line per check.

    make gpu-check                                   # all GPUs; summary in runs/gpu-check.md
    python -m bench.gpu_check [--nproc N] [--out FILE] [--quick] [--keep] [--checks a,b]
    python -m bench.gpu_check --device cpu --quick   # the same checks on CPU: gloo, tiny model

Everything runs the way a training job does: `python -m torch.distributed.run --standalone
--nproc_per_node=<every GPU>` around `python -m kubellm.train --config <json>` (one process
per GPU, nccl, bf16; KUBELLM_FORCE_DISTRIBUTED=1, so with one GPU the engine still builds
its process group and applies the strategy). The model is a ~91M-parameter Llama (hidden
768, 12 layers, 12 heads, MLP 2048) on 512-token rows of a generated English-like corpus
(`bench/corpus.py`, 8 MiB) with an 8,192-token BPE trained by prepare; 8 sequences per GPU
per step (2 micro-batches of 4). Sized to finish in under 8 minutes on one H100/H200 (an
estimate: no GPU has run it yet); the dataset is prepared once and cached under --cache-dir.

The checks, what each proves, and what it does not:

- fabric: `torchrun -m kubellm.train.fabric` with its defaults (nccl: 256 MiB all-reduce, 5
  warm-up and 20 timed iterations). Proves NCCL initialises on every GPU and all-reduces
  correctly enough to finish, and measures bus bandwidth (GB/s). It does not prove any
  bandwidth is good enough (no threshold unless --min-busbw-gbps), nor anything about the
  network between nodes or RDMA (one node; run the fabric check with --require-rdma in a
  multi-node PyTorchJob for that). With one GPU no data moves: busbw is 0 by definition.
- ddp / fsdp: a training run with strategy ddp, then fsdp (FSDP2 fully_shard), evaluate
  and export (save_model true). Proves the engine trains on these GPUs end to end with that
  strategy (nccl, bf16 autocast or FSDP2's bf16 MixedPrecisionPolicy, fused AdamW, gradient
  accumulation): the strategy the engine reports is the one asked for, the loss is finite
  and falls, the held-out loss is finite, the Hugging Face directory is written. It reports
  steady-state tokens/s, MFU and peak GPU memory as the engine prints them. It does not
  prove throughput targets (that is `bench.train_bench --device cuda`), memory headroom for
  big models, long-run stability, multi-node training or HSDP.
- export-ddp / export-fsdp: the exported directory loaded with transformers
  (AutoModelForCausalLM, AutoTokenizer) in a fresh process on the GPU, its loss on the same
  validation rows the engine evaluated (it must match the engine's eval_loss: 3 % on GPUs,
  where the engine evaluated in bf16 and FSDP2 in bf16 parameters, 0.1 % on CPU in fp32),
  then greedy generation of 8 tokens. Proves the export holds the trained weights (FSDP2's
  gathered from the shards) in a form transformers loads and generates with. It does not
  prove the model is any good, nor serving (KServe) works.
- resume-fsdp / resume-ddp: N steps straight, against N/2 steps with stop_after (a DCP
  checkpoint) and a second run resuming from that checkpoint_dir to N. Every step's printed
  loss (6 significant digits), the final train loss and every exported tensor must be
  bit-identical. These three runs use deterministic kernels (torch.use_deterministic_
  algorithms(warn_only=True), the math attention kernel instead of flash/memory-efficient,
  CUBLAS_WORKSPACE_CONFIG=:4096:8), so a difference is the checkpoint's, not the kernels':
  a difference before the checkpoint says the kernels were not deterministic after all.
  Proves model, optimizer, LR schedule, data position and RNG are saved and restored
  exactly on this node, sharded (FSDP2) and replicated (DDP). It does not prove resuming on
  a different world size, after a crash mid-write, or on a pre-emption signal
  (tests/train/test_faults.py covers those on CPU). DDP on more than 2 GPUs may differ in
  the last bits after a resume without a checkpoint bug: DDP rebuilds its gradient buckets
  after each process's first step, and with 3+ ranks NCCL's summation order follows the
  bucket layout (the failure line says so when it happens).

Exit status: 0 when every check passed, 1 otherwise. `--out` gets a markdown summary (the
table, the figures, what failed and why, the machine). `--device cpu` runs the same checks
with gloo on a tiny model (2 processes, a few steps; resume-fsdp only with --quick): the
test of this script (tests/bench/test_gpu_check.py), not a check of any hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubellm.train.loop import FORCE_DISTRIBUTED_ENV
from kubellm.train.metric_lines import parse_metrics

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("fabric", "ddp", "export-ddp", "fsdp", "export-fsdp", "resume-fsdp", "resume-ddp")
GENERATE_PREFIX = "gpu_check_generate "
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
PROVES = {
    "fabric": "NCCL (gloo on CPU) all-reduce runs on every device; bus bandwidth",
    "ddp": "training end to end with DDP: finite, falling loss; eval; export",
    "export-ddp": "the DDP export loads in transformers, matches eval_loss, generates",
    "fsdp": "training end to end with FSDP2 fully_shard: finite, falling loss; eval; export",
    "export-fsdp": "the FSDP2 export (gathered shards) loads, matches eval_loss, generates",
    "resume-fsdp": "stop + resume from a sharded DCP checkpoint is bit-exact",
    "resume-ddp": "stop + resume from a DDP DCP checkpoint is bit-exact",
}
NOT_PROVEN = (
    "multi-node traffic or RDMA (one node; `kubellm.train.fabric --require-rdma` in a "
    "multi-node job), bandwidth or throughput targets (`bench.train_bench --device cuda`), "
    "memory headroom of large models, long-run stability, HSDP, LoRA or pretrained models, "
    "resume on another world size or after a crash or signal (tests/train on CPU), serving."
)


# --- sizes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one gpu-check run; the engine config of every run is made from it."""

    device: str  # cuda | cpu
    nproc: int
    corpus_mb: float
    vocab: int
    seq_len: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    batch_per_proc: int  # sequences per process per optimizer step
    grad_accum: int
    steps: int  # the ddp and fsdp runs
    log_every: int
    resume_steps: int  # N: straight N against N/2 + resume to N
    learning_rate: float
    warmup_steps: int
    eval_batches: int
    resume_strategies: tuple[str, ...]
    threads: int  # OMP_NUM_THREADS per process
    timeout: float  # seconds per torchrun run
    new_tokens: int = 8

    @property
    def batch(self) -> int:
        return self.batch_per_proc * self.nproc

    @property
    def micro_batch(self) -> int:
        return self.batch_per_proc // self.grad_accum

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def precision(self) -> str:
        return "bf16" if self.device == "cuda" else "fp32"

    @property
    def loss_rtol(self) -> float:
        """How close the export's loss must be to the engine's eval_loss."""
        return 3e-2 if self.device == "cuda" else 1e-3


GPU: dict[str, Any] = {
    "corpus_mb": 8.0,
    "vocab": 8192,
    "seq_len": 512,
    "hidden": 768,
    "layers": 12,
    "heads": 12,
    "intermediate": 2048,
    "batch_per_proc": 8,
    "grad_accum": 2,
    "steps": 200,
    "log_every": 20,
    "resume_steps": 40,
    "learning_rate": 1e-3,
    "warmup_steps": 10,
    "eval_batches": 2,
    "resume_strategies": ("fsdp", "ddp"),
    "timeout": 600.0,
}
GPU_QUICK: dict[str, Any] = {
    **GPU,
    "steps": 60,
    "log_every": 10,
    "resume_steps": 20,
    "resume_strategies": ("fsdp",),
}
CPU: dict[str, Any] = {
    "corpus_mb": 0.25,
    "vocab": 512,
    "seq_len": 64,
    "hidden": 32,
    "layers": 1,
    "heads": 2,
    "intermediate": 64,
    "batch_per_proc": 4,
    "grad_accum": 2,
    "steps": 16,
    "log_every": 4,
    "resume_steps": 8,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
    "eval_batches": 2,
    "resume_strategies": ("fsdp", "ddp"),
    "timeout": 300.0,
}
CPU_QUICK: dict[str, Any] = {**CPU, "steps": 8, "log_every": 2, "resume_strategies": ("fsdp",)}


def make_plan(device: str, nproc: int, quick: bool, threads: int | None = None) -> Plan:
    sizes = (GPU_QUICK if quick else GPU) if device == "cuda" else (CPU_QUICK if quick else CPU)
    cpus = len(os.sched_getaffinity(0))
    return Plan(device=device, nproc=nproc, threads=threads or max(1, cpus // nproc), **sizes)


def engine_config(
    plan: Plan, dataset: Path, output_dir: Path, strategy: str, steps: int, **extra: Any
) -> dict[str, Any]:
    """The TrainConfig JSON of one engine run (validated here, once)."""
    from kubellm.config import TrainConfig

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
        **extra,
    }
    TrainConfig.model_validate(cfg)
    return cfg


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


def child_env(plan: Plan, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(plan.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # one GPU still gets a process group and the configured DDP / FSDP2 wrapping
    env[FORCE_DISTRIBUTED_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
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


# --- the checks --------------------------------------------------------------------------


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    figures: str
    seconds: float
    problem: str = ""  # why it failed (one paragraph)
    log: str = ""  # the tail of the output, for the summary

    def line(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        text = f"{verdict}  {self.name:<12} {self.figures}; {self.seconds:.0f} s"
        if not self.ok and self.problem:
            text += f"\n      {self.problem}"
        return text


def check_fabric(plan: Plan, work: Path, min_busbw: float) -> Check:
    args = ["kubellm.train.fabric"]
    if min_busbw:
        args += ["--min-busbw-gbps", str(min_busbw)]
    proc = run(torchrun(plan, *args), child_env(plan), plan.timeout, work / "logs" / "fabric.log")
    m = parse_metrics(proc.stdout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("fabric: ")), "")
    fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
    if "allreduce_busbw_gbps" in m:
        figures = (
            f"busbw {m['allreduce_busbw_gbps']:.2f} GB/s (algbw "
            f"{m.get('allreduce_algbw_gbps', math.nan):.2f} GB/s, "
            f"{m.get('allreduce_ms', math.nan):.3f} ms per {m.get('allreduce_mib', 0):g} MiB "
            f"all-reduce, {int(m.get('world_size', plan.nproc))} rank(s), "
            f"{fields.get('backend', '?')}, transport {fields.get('transport', '?')})"
        )
        if int(m.get("world_size", plan.nproc)) == 1:
            figures += "; one rank moves no data: busbw 0 by definition"
    else:
        figures = "no all-reduce figures printed"
    ok = proc.rc == 0 and not proc.timed_out and "allreduce_busbw_gbps" in m
    problem = "" if ok else f"kubellm.train.fabric failed ({proc.why()})"
    return Check("fabric", ok, figures, proc.seconds, problem, "" if ok else proc.tail())


def logged_steps(steps: int, log_every: int) -> list[int]:
    """The steps the engine prints a metric line for."""
    return [s for s in range(1, steps + 1) if s % log_every == 0 or s == steps]


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def train_problems(r: EngineRun, strategy: str, output_dir: Path, expected: list[int]) -> list[str]:
    """Why a training run does not count as a pass; [] when it does. `expected`: the steps
    that must have printed a loss."""
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
    elif len(losses) > 1 and not losses[-1] < losses[0]:
        problems.append(f"the loss did not fall: {losses[0]:.4g} at first, {losses[-1]:.4g} last")
    eval_loss = r.final.get("eval_loss")
    if eval_loss is None or not math.isfinite(eval_loss):
        problems.append(f"no finite eval_loss printed ({r.final})")
    if not exported(output_dir):
        problems.append(f"no Hugging Face export in {output_dir}")
    return problems


def exported(output_dir: Path) -> bool:
    return (output_dir / "config.json").is_file() and any(output_dir.glob("*.safetensors"))


def check_train(plan: Plan, dataset: Path, work: Path, strategy: str) -> tuple[Check, EngineRun]:
    out = work / f"{strategy}-model"
    cfg = engine_config(plan, dataset, out, strategy, plan.steps)
    config = work / f"{strategy}.json"
    config.write_text(json.dumps(cfg, indent=2))
    proc = run(
        torchrun(plan, "kubellm.train", "--config", str(config)),
        child_env(plan),
        plan.timeout,
        work / "logs" / f"{strategy}.log",
    )
    r = read_engine(proc)
    problems = train_problems(r, strategy, out, logged_steps(plan.steps, plan.log_every))
    losses = [m["loss"] for m in r.steps]
    rate = steady_rate(r.steps, plan.batch * plan.seq_len)
    mfu = mean_after_first(r.steps, "mfu")
    peak = max((m["peak_mem_gb"] for m in r.steps if "peak_mem_gb" in m), default=None)
    figures = (
        f"{plan.nproc} x {plan.device}, strategy {r.header.get('strategy', '?')}, "
        f"{r.header.get('precision', '?')}, loss {_f(losses[0] if losses else None, '.3f')} -> "
        f"{_f(losses[-1] if losses else None, '.3f')}, eval_loss "
        f"{_f(r.final.get('eval_loss'), '.3f')}, {_f(rate, ',.0f')} tokens/s "
        f"({_f(rate / plan.nproc if rate else None, ',.0f')} per device), MFU {_f(mfu, '.1%')}"
        + (f", peak GPU memory {_f(peak, '.2f')} GiB" if plan.device == "cuda" else "")
    )
    check = Check(
        strategy,
        not problems,
        figures,
        proc.seconds,
        "; ".join(problems),
        "" if not problems else proc.tail(),
    )
    return check, r


def generate_exports(
    plan: Plan, dataset: Path, dirs: list[Path], work: Path
) -> dict[str, dict[str, Any]]:
    """Load each exported directory in a fresh process and generate; dir -> its result."""
    cmd = [sys.executable, "-m", "bench.gpu_check", "_generate", "--device", plan.device]
    cmd += ["--dataset", str(dataset), "--world", str(plan.nproc)]
    cmd += ["--micro-batch", str(plan.micro_batch), "--eval-batches", str(plan.eval_batches)]
    cmd += ["--new-tokens", str(plan.new_tokens), *map(str, dirs)]
    proc = run(cmd, child_env(plan), plan.timeout, work / "logs" / "generate.log")
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
    return Check(name, not problems, figures, result["seconds"], "; ".join(problems))


# --- resume ------------------------------------------------------------------------------


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


def check_resume(plan: Plan, dataset: Path, work: Path, strategy: str) -> Check:
    name = f"resume-{strategy}"
    steps, stop = plan.resume_steps, plan.resume_steps // 2
    ckpt = work / f"{name}-ckpt"
    resumed_out = work / f"{name}-resumed-model"
    for stale in (ckpt, resumed_out, work / f"{name}-straight-model"):  # a reused --work-dir
        shutil.rmtree(stale, ignore_errors=True)
    env = child_env(plan, DETERMINISTIC_ENV)
    t0 = time.perf_counter()

    def engine(tag: str, out: Path, **extra: Any) -> EngineRun:
        cfg = engine_config(plan, dataset, out, strategy, steps, log_every=1, **extra)
        config = work / f"{name}-{tag}.json"
        config.write_text(json.dumps(cfg, indent=2))
        cmd = torchrun(plan, "bench.gpu_check", "_train", "--deterministic", "--config")
        cmd.append(str(config))
        return read_engine(run(cmd, env, plan.timeout, work / "logs" / f"{name}-{tag}.log"))

    straight = engine("straight", work / f"{name}-straight-model")
    if not straight.ok:
        return _failed_run(name, "the straight run", straight, t0)
    first = engine("first", resumed_out, checkpoint_dir=str(ckpt), stop_after=stop)
    if not first.ok:
        return _failed_run(name, f"the run stopping after step {stop}", first, t0)
    second = engine("second", resumed_out, checkpoint_dir=str(ckpt))
    if not second.ok:
        return _failed_run(name, "the resumed run", second, t0)
    if not exported(work / f"{name}-straight-model") or not exported(resumed_out):
        return Check(name, False, "no export", time.perf_counter() - t0, "an export is missing")
    a = load_weights(work / f"{name}-straight-model")
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
        f"{steps} steps straight vs {stop} + stop_after + resume to {steps} ({strategy}, "
        f"{plan.nproc} process(es), deterministic kernels): "
        + (
            f"{len(straight.losses)} step losses, final loss {_f(final_a, '.6g')} and "
            f"{len(a)} exported tensors bit-identical"
            if not problems
            else "differences found"
        )
    )
    return Check(name, not problems, figures, time.perf_counter() - t0, "; ".join(problems))


def _failed_run(name: str, which: str, r: EngineRun, t0: float) -> Check:
    return Check(
        name,
        False,
        "not compared",
        time.perf_counter() - t0,
        f"{which} failed ({r.proc.why()})",
        r.proc.tail(),
    )


# --- the summary -------------------------------------------------------------------------


def summary(
    checks: list[Check],
    plan: Plan,
    info: Mapping[str, str],
    cmd: str,
    seconds: float,
    dataset: Mapping[str, Any] | None,
    params: int | None,
) -> str:
    passed = all(c.ok for c in checks) and bool(checks)
    rows = "\n".join(
        f"| {c.name} | {'PASS' if c.ok else '**FAIL**'} | {_cell(c.figures)} | {c.seconds:.0f} |"
        for c in checks
    )
    proves = "\n".join(f"- **{c.name}**: {PROVES.get(c.name, '')}" for c in checks)
    failures = "\n\n".join(
        f"### {c.name}\n\n{c.problem}\n\n```\n{c.log.strip()}\n```"
        if c.log
        else f"### {c.name}\n\n{c.problem}"
        for c in checks
        if not c.ok
    )
    data = (
        f"{dataset['rows']['train']:,} train rows of {plan.seq_len} tokens, BPE vocab "
        f"{dataset['tokenizer'].get('vocab_size', '?')} (generated {plan.corpus_mb:g} MiB corpus)"
        if dataset
        else "not prepared"
    )
    machine = "\n".join(f"| {k} | {v} |" for k, v in info.items())
    device_line = info.get("gpu", "none") if plan.device == "cuda" else "CPU (gloo)"
    model_line = (
        f"Llama from ModelConfig, hidden {plan.hidden}, {plan.layers} layer(s), {plan.heads} "
        f"heads, MLP {plan.intermediate}: {_f(params, ',')} parameters"
    )
    batch_line = (
        f"{plan.batch_per_proc} sequences per process per step ({plan.grad_accum} "
        f"micro-batches of {plan.micro_batch}), global {plan.batch}; ddp/fsdp runs "
        f"{plan.steps} steps, resume runs {plan.resume_steps} (stop after "
        f"{plan.resume_steps // 2}); AdamW lr {plan.learning_rate:g}, {plan.warmup_steps} "
        "warmup steps"
    )
    return f"""# gpu-check: {"PASS" if passed else "FAIL"}

{info.get("date", "")}, {plan.nproc} process(es) on {device_line}; {seconds:.0f} s in all.

```
{cmd}
```

| check | result | figures | seconds |
|---|---|---|---:|
{rows}

What each check shows (the module docstring of bench/gpu_check.py says more):

{proves}

Not proven by any of them: {NOT_PROVEN}

## Setup

- {plan.nproc} process(es) under `torchrun --standalone`, {plan.backend}, {plan.precision}.
- Model: {model_line}.
- Data: {data}.
- Batch: {batch_line}.
- tokens/s: the engine's `tokens_per_sec` windows after the first, all tokens over all
  seconds; MFU: the engine's `mfu` (data-sheet dense bf16 peak on GPUs); peak memory: the
  engine's `peak_mem_gb` (rank 0's torch.cuda.max_memory_allocated, GiB).
{"" if passed else chr(10) + "## Failures" + chr(10) + chr(10) + failures + chr(10)}
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


# --- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default: a machine without a visible GPU fails) or cpu (gloo, tiny model)",
    )
    ap.add_argument("--nproc", type=int, help="processes (default: every GPU; CPU: 2)")
    ap.add_argument("--quick", action="store_true", help="fewer steps, resume-fsdp only")
    ap.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"comma-separated subset of {','.join(CHECKS)} (export-X needs X)",
    )
    ap.add_argument("--min-busbw-gbps", type=float, default=0.0, help="fabric threshold")
    ap.add_argument("--out", default="runs/gpu-check.md", help="markdown summary")
    ap.add_argument("--cache-dir", default="runs/bench", help="dataset cache")
    ap.add_argument("--work-dir", default="", help="scratch (default: a new dir in cache-dir)")
    ap.add_argument("--keep", action="store_true", help="keep exports, checkpoints and logs")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS per process")
    args = ap.parse_args(argv)
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}; allowed: {', '.join(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_train"]:
        return train_worker(argv[1:])
    if argv[:1] == ["_generate"]:
        return generate_worker(argv[1:])
    args = parse_args(argv)
    cmd = shlex.join(["python", "-m", "bench.gpu_check", *argv])
    import torch

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print(
            f"FAIL  gpu-check: torch {torch.__version__} sees no GPU (CUDA build: "
            f"{torch.version.cuda or 'no, a CPU-only torch'}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); --device cpu runs the CPU "
            "version of the checks",
            flush=True,
        )
        return 1
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    nproc = args.nproc or (gpus if device == "cuda" else 2)
    if device == "cuda" and nproc > gpus:
        print(f"FAIL  gpu-check: --nproc {nproc} but {gpus} GPU(s) visible", flush=True)
        return 1
    plan = make_plan(device, nproc, args.quick, args.threads)
    asked = args.checks.split(",")
    explicit = args.checks != ",".join(CHECKS)  # --checks given: exactly those
    wanted = [
        c
        for c in CHECKS
        if c in asked
        and (explicit or not c.startswith("resume-") or c[7:] in plan.resume_strategies)
    ]
    cache = Path(args.cache_dir).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    work = (
        Path(args.work_dir).resolve()
        if args.work_dir
        else Path(tempfile.mkdtemp(dir=cache, prefix="gpu-check-"))
    )
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(
        f"gpu-check: {plan.nproc} x {device} ({plan.backend}, {plan.precision}), checks "
        f"{', '.join(wanted)}; scratch {work}",
        flush=True,
    )
    checks: list[Check] = []
    manifest: dict[str, Any] | None = None
    params: int | None = None

    def record(check: Check) -> None:
        checks.append(check)
        print(check.line(), flush=True)

    try:
        dataset: Path | None = None
        try:
            dataset = prepare(plan, cache)
            manifest = json.loads((dataset / "manifest.json").read_text())
            params = model_params(plan, int(manifest["tokenizer"].get("vocab_size", plan.vocab)))
        except Exception as err:  # the checks cannot run: say why, once
            record(Check("dataset", False, "not prepared", time.perf_counter() - t0, repr(err)))
        if "fabric" in wanted:
            record(check_fabric(plan, work, args.min_busbw_gbps))
        if dataset is not None:
            run_training_checks(plan, dataset, work, wanted, record)
    finally:
        seconds = time.perf_counter() - t0
        passed = all(c.ok for c in checks) and bool(checks)
        if not args.keep:
            _clean(work, keep_logs=not passed)
    info = _machine(plan)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(summary(checks, plan, info, cmd, seconds, manifest, params))
    kept = f"; logs in {work / 'logs'}" if args.keep or not passed else ""
    print(
        f"gpu-check: {'PASS' if passed else 'FAIL'} ({sum(c.ok for c in checks)}/{len(checks)} "
        f"checks passed, {seconds:.0f} s); summary {out}{kept}",
        flush=True,
    )
    return 0 if passed else 1


def run_training_checks(
    plan: Plan, dataset: Path, work: Path, wanted: list[str], record: Callable[[Check], None]
) -> None:
    trained: dict[str, EngineRun] = {}
    for strategy in ("ddp", "fsdp"):
        if strategy in wanted:
            check, r = check_train(plan, dataset, work, strategy)
            record(check)
            if check.ok:
                trained[strategy] = r
    exports = [s for s in ("ddp", "fsdp") if f"export-{s}" in wanted]
    if exports:
        dirs = {s: work / f"{s}-model" for s in exports if s in trained}
        results = generate_exports(plan, dataset, list(dirs.values()), work) if dirs else {}
        for s in exports:
            result = results.get(str(dirs[s])) if s in dirs else None
            record(export_check(plan, s, trained.get(s), result))
    for strategy in ("fsdp", "ddp"):
        if f"resume-{strategy}" in wanted:
            record(check_resume(plan, dataset, work, strategy))


def prepare(plan: Plan, cache: Path) -> Path:
    from bench.train_bench import prepare_dataset

    return prepare_dataset(
        cache,
        num_records=0,
        vocab=plan.vocab,
        seq_len=plan.seq_len,
        seed=0,
        corpus_mb=plan.corpus_mb,
    )


def model_params(plan: Plan, vocab: int) -> int:
    """Parameters of the check's model (built on the meta device)."""
    import torch

    from bench.train_bench import _Vocab
    from kubellm.config import ModelConfig
    from kubellm.train.model import new_llama

    cfg = ModelConfig(
        hidden_size=plan.hidden,
        num_layers=plan.layers,
        num_heads=plan.heads,
        intermediate_size=plan.intermediate,
        max_position_embeddings=max(128, plan.seq_len),
    )
    with torch.device("meta"):
        model = new_llama(cfg, _Vocab(vocab))  # type: ignore[arg-type]
    return sum(p.numel() for p in model.parameters())


def _machine(plan: Plan) -> dict[str, str]:
    from bench.machine import machine_info

    info = machine_info(("torch", "transformers"))
    info["gpu"] = "none"
    if plan.device == "cuda":
        import torch

        with contextlib.suppress(Exception):
            info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
            info["cuda"] = str(torch.version.cuda)
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def _clean(work: Path, keep_logs: bool) -> None:
    """Exports and checkpoints go (they are large on GPUs); the logs stay after a failure."""
    if not keep_logs:
        shutil.rmtree(work, ignore_errors=True)
        return
    for child in work.iterdir():
        if child.name != "logs":
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


# --- the workers: run inside torchrun / a fresh process ----------------------------------


def train_worker(argv: list[str]) -> int:
    """`kubellm.train`'s own entry point, optionally with deterministic kernels first."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check _train")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    if args.deterministic:
        import torch

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
    from kubellm.train.loop import main as train_main

    return train_main(["--config", args.config])


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
