"""Benchmark of training throughput (issue 4): kubellm.train against two peers, same work.

On this machine, in one run: the same tiny Llama (kubellm.train.model.new_llama, seeded), the
same prepared dataset, global batch, sequence length, step count, AdamW settings, clip and
warmup + cosine schedule, 2 processes under torchrun (gloo on CPU), three contenders:

1. kubellm: `python -m kubellm.train --config <json>` (no checkpoints, no export).
2. the Hugging Face Trainer (`bench/peers/hf_trainer.py`); target: kubellm >= 1.0 x it.
3. a minimal hand-written DDP loop (`bench/peers/ddp_loop.py`), the floor; target:
   kubellm >= 0.95 x it (the engine's overhead is small).

Each is measured the same way: steady-state tokens/s, the tokens of steps (skip, steps]
over the wall time of those steps on rank 0, so start-up, first-step and warmup costs are
left out. kubellm's figure comes from its own `tokens_per_sec` metric windows after the
skip (the only interface the bench relies on: the CLI and its `name=value` lines); the
peers time the same span themselves. As a cross-check, the parent also timestamps the
stdout lines that mark the end of step `skip` and of the last step, for all three.
The contenders run interleaved for `--repeats` rounds (the order rotates); the report gives
best-of and per-repeat ratios, the final loss of each (they train the same thing, so the
losses should agree) and MFU where the engine prints it (on CPU against a measured matmul
peak, on GPUs against the data-sheet bf16 peak): on a GPU machine the same command runs
the contenders on the GPUs (nccl, bf16) and reads as an MFU report.

GPU mode (`--device cuda`, or `auto` on a machine with GPUs) uses the `gpu-1b` preset unless
told otherwise (`--preset cpu` keeps the CPU model on the GPUs, at most 2 of them): a Llama
of about 1.1B parameters shaped like Llama 3.2 1B with full multi-head attention (hidden
2048, 16 layers, 16 heads of 128, MLP 8192, tied embeddings; ModelConfig has no GQA), a
byte-level BPE of 32,000 tokens trained by prepare on a generated English-like corpus
(`bench/corpus.py`, 32 MiB, packed to 2,048-token rows), every GPU of the node (nproc =
torch.cuda.device_count()), bf16, 8 sequences per GPU per step (micro-batches of 4, 2
accumulation steps), AdamW lr 3e-4. The report then also gives MFU for every contender
(tokens/s x the PaLM FLOPs per token of `kubellm.train.mfu.model_flops_per_token` / GPUs /
the data-sheet dense bf16 peak of `kubellm.train.mfu.gpu_peak`) and each contender's peak
GPU memory (`torch.cuda.max_memory_allocated` on rank 0, GiB: the engine's `peak_mem_gb`
metric, the peers' `bench_peak_mem_gb`). On GPUs the peers also leave out what the engine
does not do per step: the HF Trainer runs with `logging_nan_inf_filter=False` (its default
reads the loss on the host every step), `average_tokens_across_devices=False` (an all-gather
per step; the engine, like the loop, averages each rank's mean loss) and
`ddp_broadcast_buffers=False`, and the DDP loop with `broadcast_buffers=False` (the
engine's DDP setting); on CPU the peers run exactly as before.

Like with like is recorded, not assumed: each peer prints what it actually built (its
optimizer's class, fused / foreach, lr, betas, eps, weight decay; the model's class,
parameters and a hash of its initial weights; batch per process, precision, torch
threads), and a one-step probe run of the engine (`bench/peers/engine_probe.py`, before
the measured runs) reports the same for kubellm.train; the report tabulates them side by
side and marks any setting that differs.

    python -m bench.train_bench [--repeats 3] [--out docs/benchmarks-train.md] [--check]
    python -m bench.train_bench --quick --out /tmp/train-bench.md     # the smoke test's size
    python -m bench.train_bench --device cuda [--preset gpu-1b] --out /tmp/train-gpu.md
    python -m bench.train_bench --device cuda --preset gpu-1b --nproc 8 --dry-run  # no GPU needed
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.machine import machine_info as base_machine_info
from kubellm.train.metric_lines import parse_metrics

REPO = Path(__file__).resolve().parents[1]
TARGET_HF = 1.0  # kubellm / HF Trainer tokens/s, at least
TARGET_FLOOR = 0.95  # kubellm / minimal DDP loop tokens/s, at least
CONTENDERS = ("kubellm", "hf_trainer", "ddp_loop")
LABELS = {
    "kubellm": "kubellm.train",
    "hf_trainer": "HF Trainer",
    "ddp_loop": "minimal DDP loop",
}
MODULES = {
    "kubellm": "kubellm.train",
    "hf_trainer": "bench.peers.hf_trainer",
    "ddp_loop": "bench.peers.ddp_loop",
}
# The engine's metric for rank 0's torch.cuda.max_memory_allocated, in GiB (2**30 bytes),
# printed in its `name=value` lines on GPUs; the peers print `bench_peak_mem_gb`, same unit.
ENGINE_PEAK_MEM = "peak_mem_gb"


# --- the setup -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything the three contenders share; one TrainConfig JSON carries it to all of them."""

    steps: int
    skip: int
    log_every: int
    batch: int
    seq_len: int
    num_records: int
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    nproc: int
    device: str  # cpu | cuda
    precision: str  # fp32 | bf16
    threads: int  # OMP_NUM_THREADS per process
    seed: int
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    grad_accum: int = 1  # micro-batches per step (batch is per step, all processes)
    corpus_mb: float = 0.0  # 0: the synthetic arithmetic records; else bench.corpus, MiB
    preset: str = "cpu"

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


def train_config(setup: Setup, dataset_dir: Path, output_dir: Path) -> dict[str, Any]:
    """The TrainConfig JSON all three read."""
    from kubellm.config import TrainConfig

    cfg: dict[str, Any] = {
        "dataset_dir": str(dataset_dir),
        "output_dir": str(output_dir),
        "steps": setup.steps,
        "batch_size": setup.batch,
        "learning_rate": setup.learning_rate,
        "weight_decay": setup.weight_decay,
        "warmup_steps": setup.warmup_steps,
        "grad_clip": setup.grad_clip,
        "seed": setup.seed,
        "log_every": setup.log_every,
        "eval_batches": 1,
        "adam_beta2": setup.adam_beta2,
        "save_model": False,
        "backend": "nccl" if setup.device == "cuda" else "gloo",
        "precision": setup.precision,
        "strategy": "ddp",
        "grad_accum_steps": setup.grad_accum,
        "model": {
            "hidden_size": setup.hidden,
            "num_layers": setup.layers,
            "num_heads": setup.heads,
            "intermediate_size": setup.intermediate,
            "max_position_embeddings": max(128, setup.seq_len),
        },
    }
    TrainConfig.model_validate(cfg)  # fail here, once, rather than in six torchrun jobs
    return cfg


def ensure_dataset(cache_dir: Path, setup: Setup) -> Path:
    """The bench's dataset (kubellm.data.prepare), prepared once per shape and cached."""
    return prepare_dataset(
        cache_dir,
        num_records=setup.num_records,
        vocab=setup.vocab,
        seq_len=setup.seq_len,
        seed=setup.seed,
        corpus_mb=setup.corpus_mb,
    )


def prepare_dataset(
    cache_dir: Path, *, num_records: int, vocab: int, seq_len: int, seed: int, corpus_mb: float
) -> Path:
    """A dataset prepared once per shape and cached under `cache_dir`.

    `corpus_mb` 0: `num_records` synthetic arithmetic records (a few tokens each: the CPU
    bench's data). Otherwise the generated English-like corpus of that many MiB
    (`bench.corpus`, documents of 300 to 3,000 characters, concatenated with EOS and packed
    to `seq_len`), on which prepare trains a byte-level BPE of `vocab` tokens: the data for
    long rows and a real-sized vocabulary (16 MiB gives about 1,300 rows of 2,048 tokens
    with a 32,000-token BPE).
    """
    if corpus_mb:
        name = f"train-data-corpus{corpus_mb:g}mib-v{vocab}-s{seq_len}-seed{seed}"
    else:
        name = f"train-data-r{num_records}-v{vocab}-s{seq_len}-seed{seed}"
    path = cache_dir / name
    if (path / "manifest.json").is_file():
        return path
    from kubellm.data.prepare import PrepareParams, prepare

    cache_dir.mkdir(parents=True, exist_ok=True)
    if corpus_mb:
        from bench.corpus import ensure_corpus

        corpus = ensure_corpus(cache_dir, corpus_mb, seed)
        params = PrepareParams(
            source=str(corpus.path), vocab_size=vocab, seq_len=seq_len, seed=seed
        )
    else:
        params = PrepareParams(
            num_records=num_records, vocab_size=vocab, seq_len=seq_len, seed=seed
        )
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".train-data-"))
    with contextlib.redirect_stdout(sys.stderr):
        prepare(params, tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


# --- one run -----------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One contender's figures from one repeat."""

    contender: str
    repeat: int
    tokens_per_sec: float  # steady state, the contender's own clock (engine: its windows)
    parent_tokens_per_sec: float  # the same span timed by the parent from stdout lines
    loss: float  # the last loss it reports (see the report for what each one means)
    mfu: float | None  # the engine's, steady windows; None when it prints none
    flops_per_token: float | None  # peers: the PaLM formula (the engine's MFU formula)
    threads: int | None  # torch threads per process (peers report it)
    wall_s: float  # the whole torchrun command, start-up included
    settings: dict[str, Any] | None = None  # a peer's `bench_setup` line: what it ran
    peak_mem_gib: float | None = None  # GPUs: rank 0's torch.cuda.max_memory_allocated, GiB


def command(contender: str, setup: Setup, config: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={setup.nproc}", "-m", MODULES[contender], "--config", str(config)]
    if contender != "kubellm":
        cmd += ["--skip", str(setup.skip)]
    return cmd


def child_env(setup: Setup) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(setup.threads)  # torchrun's default too, but explicit
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_once(
    contender: str, setup: Setup, config: Path, repeat: int, work: Path, timeout: float
) -> Run:
    """Run one contender under torchrun, timestamping each stdout line as it arrives."""
    cmd = command(contender, setup, config)
    stamped: list[tuple[float, str]] = []
    with tempfile.TemporaryFile(mode="w+", dir=work) as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=child_env(setup),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: a timeout kills all its ranks
        )
        timer = threading.Timer(timeout, _kill_group, (proc,))
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                stamped.append((time.perf_counter(), line.rstrip("\n")))
            rc = proc.wait()
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        err.seek(0)
        stderr = err.read()
    text = "\n".join(line for _, line in stamped)
    if rc != 0:
        why = f"timed out after {timeout:.0f} s" if rc in (-9, 137) else f"exit {rc}"
        raise RuntimeError(
            f"{contender} failed ({why}): {shlex.join(cmd)}\n--- stdout\n{text[-3000:]}\n"
            f"--- stderr\n{stderr[-3000:]}"
        )
    try:
        parse = parse_engine if contender == "kubellm" else parse_peer
        return parse(contender, stamped, setup, repeat, wall)
    except (ValueError, KeyError, ZeroDivisionError) as e:
        raise RuntimeError(f"{contender}: cannot read its figures ({e}):\n{text[-3000:]}") from e


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _parent_rate(marks: dict[int, float], setup: Setup) -> float:
    """Tokens/s of steps (skip, steps] from the parent's timestamps of the two mark lines."""
    span = marks[setup.steps] - marks[setup.skip]
    return (setup.steps - setup.skip) * setup.tokens_per_step / span


def parse_engine(
    contender: str, stamped: list[tuple[float, str]], setup: Setup, repeat: int, wall: float
) -> Run:
    """kubellm's figures from its metric lines: the windows that start at or after `skip`.

    Each `step=S ... tokens_per_sec=R` line covers the steps since the previous one, so a
    window of n steps took n x tokens_per_step / R seconds; the steady rate is all those
    tokens over all those seconds (a step-weighted harmonic mean, not a mean of rates).
    """
    prev = 0
    tokens = seconds = mfu_seconds = 0.0
    has_mfu = True
    loss = math.nan
    peak_mem: float | None = None
    marks: dict[int, float] = {}
    for t, line in stamped:
        m = parse_metrics(line)
        if ENGINE_PEAK_MEM in m:  # GiB so far on rank 0: the last line has the run's peak
            peak_mem = max(peak_mem or 0.0, m[ENGINE_PEAK_MEM])
        if "step" not in m or "tokens_per_sec" not in m:
            continue
        step = int(m["step"])
        marks[step] = t
        if step == setup.steps:
            loss = m.get("loss", math.nan)
        n, start = step - prev, prev
        prev = step
        if start < setup.skip or n <= 0:
            continue
        window_s = n * setup.tokens_per_step / m["tokens_per_sec"]
        tokens += n * setup.tokens_per_step
        seconds += window_s
        if "mfu" in m:
            mfu_seconds += m["mfu"] * window_s  # time-weighted: the steady-state MFU
        else:
            has_mfu = False
    if prev != setup.steps or seconds == 0:
        raise ValueError(f"metric lines end at step {prev}, expected {setup.steps}")
    return Run(
        contender=contender,
        repeat=repeat,
        tokens_per_sec=tokens / seconds,
        parent_tokens_per_sec=_parent_rate(marks, setup),
        loss=loss,
        mfu=mfu_seconds / seconds if has_mfu else None,
        flops_per_token=None,
        threads=None,
        wall_s=wall,
        peak_mem_gib=peak_mem,
    )


def parse_peer(
    contender: str, stamped: list[tuple[float, str]], setup: Setup, repeat: int, wall: float
) -> Run:
    """A peer's `bench_*` result line, its two `bench_step=` marks and its setup line."""
    result: dict[str, float] = {}
    marks: dict[int, float] = {}
    settings = None
    for t, line in stamped:
        if line.startswith(SETUP_PREFIX):
            settings = json.loads(line[len(SETUP_PREFIX) :])
            continue
        m = parse_metrics(line)
        if "bench_step" in m:
            marks[int(m["bench_step"])] = t
        if "bench_tokens_per_sec" in m:
            result = m
    return Run(
        contender=contender,
        repeat=repeat,
        tokens_per_sec=result["bench_tokens_per_sec"],
        parent_tokens_per_sec=_parent_rate(marks, setup),
        loss=result.get("bench_loss", math.nan),
        mfu=None,
        flops_per_token=result.get("bench_flops_per_token"),
        threads=int(result["bench_threads"]) if "bench_threads" in result else None,
        wall_s=wall,
        settings=settings,
        peak_mem_gib=result.get("bench_peak_mem_gb"),
    )


def describe_engine(setup: Setup, config: Path, timeout: float) -> dict[str, Any]:
    """What kubellm.train builds for this config: a one-step run under the engine probe.

    The optimizer, model and threads come from the probe's `bench_setup` line; precision and
    batch per process from the engine's own `train: ... precision=... micro_batch=...` line.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={setup.nproc}", "-m", "bench.peers.engine_probe"]
    cmd += ["--config", str(config)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=child_env(setup), capture_output=True, text=True, timeout=timeout
    )
    lines = proc.stdout.splitlines()
    found = [json.loads(ln[len(SETUP_PREFIX) :]) for ln in lines if ln.startswith(SETUP_PREFIX)]
    header = next((ln for ln in lines if "precision=" in ln and "micro_batch=" in ln), "")
    if proc.returncode != 0 or not found or not header:
        raise RuntimeError(
            f"engine probe failed (exit {proc.returncode}): {shlex.join(cmd)}\n--- stdout\n"
            f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )
    fields = dict(f.split("=", 1) for f in header.split() if "=" in f)
    return {
        **found[0],
        "batch_per_process": int(fields["micro_batch"]) * int(fields["grad_accum_steps"]),
        "precision": fields["precision"],
    }


# --- the runs ----------------------------------------------------------------------------


def measure(setup: Setup, config: Path, work: Path, repeats: int, timeout: float) -> list[Run]:
    """All contenders, interleaved; the order rotates so no one always goes first."""
    runs: list[Run] = []
    for r in range(repeats):
        order = CONTENDERS[r % 3 :] + CONTENDERS[: r % 3]
        got: dict[str, Run] = {}
        for name in order:
            got[name] = run_once(name, setup, config, r + 1, work, timeout)
            runs.append(got[name])
        k = got["kubellm"].tokens_per_sec
        print(
            f"  repeat {r + 1}/{repeats}: "
            + ", ".join(
                f"{LABELS[n]} {got[n].tokens_per_sec:,.0f} tok/s (loss {got[n].loss:.3f})"
                for n in CONTENDERS
            )
            + f"; kubellm/HF {k / got['hf_trainer'].tokens_per_sec:.2f}, "
            f"kubellm/DDP loop {k / got['ddp_loop'].tokens_per_sec:.2f}",
            flush=True,
        )
    return runs


def by_contender(runs: list[Run]) -> dict[str, list[Run]]:
    return {name: [r for r in runs if r.contender == name] for name in CONTENDERS}


def ratios(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Best-of ratios (the verdict) and per-repeat ratios (the noise check) for both peers."""
    groups = by_contender(runs)
    best = {n: max(r.tokens_per_sec for r in rs) for n, rs in groups.items()}
    out: dict[str, dict[str, Any]] = {}
    for peer, target in (("hf_trainer", TARGET_HF), ("ddp_loop", TARGET_FLOOR)):
        per = [
            k.tokens_per_sec / p.tokens_per_sec
            for k, p in zip(groups["kubellm"], groups[peer], strict=True)
        ]
        ratio = best["kubellm"] / best[peer]
        out[peer] = {
            "ratio": ratio,
            "per_repeat": per,
            "median": statistics.median(per),
            "target": target,
            "pass": ratio >= target,
        }
    return out


def mfu_of(run: Run, kubellm_run: Run, gpu: GpuPeak | None = None) -> float | None:
    """MFU: the engine's own figure; a peer's at the same FLOPs/token and peak, by its rate.

    The engine's MFU is tokens/s x FLOPs/token / processes / peak; a peer in the same
    repeat trains the same model on the same device, so its MFU is the engine's scaled by
    the ratio of tokens/s (the engine's CPU peak is measured per run, hence same repeat).
    On GPUs (`gpu`: the data-sheet peak and the peers' FLOPs per token) every contender's
    MFU is computed here the same way, from its own tokens/s.
    """
    if gpu is not None:
        return run.tokens_per_sec * gpu.flops_per_token / gpu.nproc / gpu.peak
    if kubellm_run.mfu is None:
        return None
    return kubellm_run.mfu * run.tokens_per_sec / kubellm_run.tokens_per_sec


@dataclasses.dataclass(frozen=True)
class GpuPeak:
    """What a GPU run's MFU is computed against."""

    name: str  # torch.cuda.get_device_name(0)
    peak: float  # dense bf16 FLOP/s of one GPU (kubellm.train.mfu.gpu_peak)
    flops_per_token: float  # the peers' kubellm.train.mfu.model_flops_per_token
    nproc: int


def gpu_peak_of(setup: Setup, runs: list[Run], device_name: str | None) -> GpuPeak | None:
    """The GPU MFU basis of a cuda run; None on CPU, an unknown GPU or no FLOPs figure."""
    if setup.device != "cuda" or not device_name:
        return None
    from kubellm.train import mfu

    peak = mfu.gpu_peak(device_name)
    fpt = next((r.flops_per_token for r in runs if r.flops_per_token), None)
    if not peak or not fpt:
        return None
    return GpuPeak(device_name, peak, fpt, setup.nproc)


# --- the report --------------------------------------------------------------------------

SETUP_PREFIX = "bench_setup "  # bench.peers.SETUP_PREFIX (not imported: that loads torch)

SETTING_ROWS: tuple[tuple[str, Any], ...] = (
    ("optimizer", lambda s: f"`{s['optimizer']}`"),
    (
        "implementation (fused / foreach)",
        lambda s: f"{s['implementation']} ({s['fused']} / {s['foreach']})",
    ),
    ("peak lr", lambda s: f"{s['lr']:g}"),
    ("betas", lambda s: "(" + ", ".join(f"{b:g}" for b in s["betas"]) + ")"),
    ("eps", lambda s: f"{s['eps']:g}"),
    ("weight decay", lambda s: ", ".join(f"{w:g}" for w in s["weight_decay"])),
    ("model", lambda s: f"{s['model']}, {s['params']:,} parameters"),
    ("initial weights (sha256)", lambda s: f"`{s['init_hash']}`"),
    ("batch per process", lambda s: str(s["batch_per_process"])),
    ("precision", lambda s: str(s["precision"])),
    ("torch threads (intra-op / inter-op)", lambda s: f"{s['threads']} / {s['interop_threads']}"),
)


def contender_settings(runs: list[Run], engine: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> what it ran: the engine's from the probe, each peer's from its first run."""
    out = {"kubellm": engine}
    for name, rs in by_contender(runs).items():
        if name != "kubellm":
            got = [r.settings for r in rs if r.settings]
            if not got:
                raise RuntimeError(f"{name} printed no {SETUP_PREFIX.strip()} line")
            out[name] = got[0]
    return out


def settings_table(settings: dict[str, dict[str, Any]]) -> str:
    """One row per setting, one column per contender, and whether they all agree."""
    rows = [
        "| setting | " + " | ".join(LABELS[n] for n in CONTENDERS) + " | same for all |",
        "|---|" + "---|" * len(CONTENDERS) + "---|",
    ]
    for title, cell in SETTING_ROWS:
        cells = []
        for name in CONTENDERS:
            try:
                cells.append(cell(settings[name]))
            except (KeyError, TypeError, ValueError):
                cells.append("?")
        same = "yes" if len(set(cells)) == 1 and "?" not in cells else "**no**"
        rows.append(f"| {title} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(rows)


def machine_info(setup: Setup) -> dict[str, str]:
    info = base_machine_info(("torch", "transformers", "accelerate", "pyarrow"))
    info["gpu"] = "none"
    if setup.device == "cuda":
        import torch

        info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return info


def _load() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return format(x, spec) if x is not None and math.isfinite(x) else "n/a"


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def gpu_figures(setup: Setup, runs: list[Run], gpu: GpuPeak | None) -> str:
    """The GPU section of the report (empty on CPU): per-GPU tokens/s, MFU, peak memory."""
    if setup.device != "cuda":
        return ""
    groups = by_contender(runs)
    rows = [
        "| contender | best tokens/s | per GPU | MFU, best run | peak GPU memory GiB, per run |",
        "|---|---:|---:|---:|---|",
    ]
    for name, rs in groups.items():
        best = max(rs, key=lambda r: r.tokens_per_sec)
        mfu = mfu_of(best, best, gpu) if gpu is not None else None
        mem = ", ".join(_fmt(r.peak_mem_gib, ".2f") for r in rs)
        rows.append(
            f"| {LABELS[name]} | {_fmt(best.tokens_per_sec)} "
            f"| {_fmt(best.tokens_per_sec / setup.nproc)} | {_fmt(mfu, '.1%')} | {mem} |"
        )
    basis = (
        f"{gpu.name}: {gpu.peak / 1e12:g} TFLOP/s dense bf16 (data sheet, "
        f"`kubellm.train.mfu.gpu_peak`), {gpu.flops_per_token:,.0f} FLOPs per token "
        "(`kubellm.train.mfu.model_flops_per_token`, the PaLM formula)"
        if gpu is not None
        else "no data-sheet peak known for this GPU (or no FLOPs figure): MFU n/a"
    )
    engine_mem = (
        ""
        if any(r.peak_mem_gib is not None for r in groups["kubellm"])
        else f" The engine printed no `{ENGINE_PEAK_MEM}=` metric in this run: its memory is n/a."
    )
    return f"""
## GPU figures

{chr(10).join(rows)}

- {setup.nproc} GPU(s), one process each, nccl, {setup.precision}, preset `{setup.preset}`.
- MFU: tokens/s x FLOPs per token / GPUs / peak; {basis}.
- Peak GPU memory: `torch.cuda.max_memory_allocated` on rank 0 over the whole run, GiB
  (2^30 bytes): the engine's `{ENGINE_PEAK_MEM}` metric (its last metric line), the peers'
  `bench_peak_mem_gb`.{engine_mem}
"""


def report(
    setup: Setup,
    runs: list[Run],
    info: dict[str, str],
    cmd: str,
    dataset: dict[str, Any],
    loads: tuple[str, str],
    settings: dict[str, dict[str, Any]],
    gpu: GpuPeak | None = None,
) -> tuple[str, str, dict[str, dict[str, Any]]]:
    """(the results table, the whole markdown report, the ratios)."""
    groups = by_contender(runs)
    rat = ratios(runs)
    best = {n: max(rs, key=lambda r: r.tokens_per_sec) for n, rs in groups.items()}
    kub = best["kubellm"].tokens_per_sec
    rows = [
        "| metric | kubellm | peer | ratio | target | result |",
        "|---|---:|---:|---:|---|---|",
    ]
    for peer, title in (
        ("hf_trainer", "tokens/s vs HF Trainer"),
        ("ddp_loop", "tokens/s vs minimal DDP loop"),
    ):
        x = rat[peer]
        rows.append(
            f"| {title} (per repeat {', '.join(f'{v:.2f}' for v in x['per_repeat'])}) "
            f"| {_fmt(kub)} | {_fmt(best[peer].tokens_per_sec)} | {x['ratio']:.2f} "
            f"| ≥ {x['target']} | {_verdict(x['pass'])} |"
        )
    table = "\n".join(rows)

    n = len(groups["kubellm"])
    header = " | ".join(f"run {i + 1}" for i in range(n))
    contender_rows = []
    for name, rs in groups.items():
        rates = " | ".join(_fmt(r.tokens_per_sec) for r in rs)
        parent = ", ".join(_fmt(r.parent_tokens_per_sec) for r in rs)
        losses = ", ".join(_fmt(r.loss, ".4f") for r in rs)
        mfus = ", ".join(
            _fmt(mfu_of(r, k, gpu), ".1%") for r, k in zip(rs, groups["kubellm"], strict=True)
        )
        walls = ", ".join(f"{r.wall_s:.0f}" for r in rs)
        contender_rows.append(
            f"| {LABELS[name]} | {rates} | {_fmt(best[name].tokens_per_sec)} "
            f"| {_fmt(statistics.median(r.tokens_per_sec for r in rs))} | {parent} | {losses} "
            f"| {mfus} | {walls} |"
        )
    fpt = next((r.flops_per_token for r in runs if r.flops_per_token), None)
    gflops = (
        ", ".join(
            f"{LABELS[n]} {_fmt(best[n].tokens_per_sec * fpt / 1e9, ',.2f')}" for n in CONTENDERS
        )
        if fpt
        else "n/a"
    )
    threads = sorted({r.threads for r in runs if r.threads is not None})
    engine_mfu = "; ".join(f"run {r.repeat}: {_fmt(r.mfu, '.1%')}" for r in groups["kubellm"])
    mfu_note = (
        f"the engine printed `mfu=` ({engine_mfu}); the peers' MFU is the engine's scaled by "
        "their tokens/s in the same repeat (same model, FLOPs/token and device peak)."
        if all(r.mfu is not None for r in groups["kubellm"])
        else "the engine printed no `mfu=` value in this run: MFU is n/a."
    )
    if gpu is not None:
        mfu_note = (
            f"every contender's tokens/s x {gpu.flops_per_token:,.0f} FLOPs/token / "
            f"{gpu.nproc} GPU(s) / {gpu.peak / 1e12:g} TFLOP/s, the dense bf16 data-sheet peak "
            f"of one {gpu.name} (see GPU figures below); the engine's own `mfu=`: {engine_mfu}."
        )
    elif setup.device == "cuda":
        mfu_note += (
            " (No data-sheet bf16 peak is known for this GPU, or no peer printed its "
            "FLOPs per token.)"
        )
    machine = "\n".join(f"| {k} | {v} |" for k, v in info.items())
    source = (
        f"documents of a generated {setup.corpus_mb:g} MiB English-like corpus, bench/corpus.py"
        if setup.corpus_mb
        else "synthetic records"
    )
    data_line = (
        f"{dataset['rows']['train']:,} train rows of {setup.seq_len} tokens "
        f"({dataset['tokens']['train']:,} tokens; {int(dataset['records']['read']):,} {source}, "
        f"BPE vocab {dataset['tokenizer'].get('vocab_size', '?')})"
    )
    per_process = f"{setup.batch // setup.nproc} per process"
    if setup.grad_accum > 1:
        micro = setup.batch // setup.nproc // setup.grad_accum
        per_process += f": {setup.grad_accum} micro-batches of {micro}"
    dev = (
        f"{setup.nproc} processes, gloo, CPU, {setup.threads} torch thread(s) each"
        if setup.device == "cpu"
        else f"{setup.nproc} process(es), nccl, one GPU each"
    )
    md = f"""# Training-throughput benchmark

Issue 4's targets, measured in one run on this machine ({info["nproc"]} CPUs, \
{info["date"]}). Rerun with `make bench` (or `make bench-train`), or:

```
{cmd}
```

## Results

{table}

Steady-state tokens/s, best of {n} interleaved repeat(s) (the order of the three rotates each
repeat); the ratio in brackets is kubellm over the peer within each repeat, runs seconds
apart (the machine is shared: load average {loads[0]} at the start, {loads[1]} at the end).

## Runs

| contender | {header} | best | median | parent clock, per run | final loss, per run \
| MFU, per run | wall s, per run |
|---|{"---:|" * n}---:|---:|---|---|---|---|
{chr(10).join(contender_rows)}

- tokens/s: tokens of steps {setup.skip + 1} to {setup.steps} ({setup.tokens_per_step:,} per
  step) over the wall time of those steps on rank 0. kubellm: from its own
  `tokens_per_sec` windows (`log_every={setup.log_every}`) that start at or after step
  {setup.skip}, all tokens over all seconds. Peers: `time.perf_counter()` on rank 0 at the
  end of step {setup.skip} and of step {setup.steps} (the HF Trainer's in a TrainerCallback's
  `on_step_end`), with a device sync on GPUs.
- parent clock: the same span timed by this process from the arrival of the stdout line
  marking step {setup.skip} and step {setup.steps} (kubellm: its metric lines; peers:
  `bench_step=` marks); includes what the engine's own windows leave out (printing).
- final loss: kubellm and the DDP loop, the last step's loss averaged over the ranks (same
  initial weights, same rows in the same order: they should agree to a few decimals); HF
  Trainer, its last logged loss (mean of the last {setup.log_every} steps, its own data order).
- MFU: {mfu_note}
- Achieved model FLOP/s (PaLM formula, {_fmt(fpt, ",.0f")} FLOPs/token), best run, GFLOP/s:
  {gflops}.
- wall s: the whole torchrun command (start-up, data load, eval at the end included).

## What is compared

All three: `python -m torch.distributed.run --standalone --nproc_per_node={setup.nproc}`,
{dev} (`OMP_NUM_THREADS={setup.threads}` set for all; peers report \
{", ".join(map(str, threads)) or "?"} thread(s)),
precision {setup.precision}, the same TrainConfig JSON: Llama from `kubellm.train.model.new_llama`
(hidden {setup.hidden}, {setup.layers} layers, {setup.heads} heads, intermediate \
{setup.intermediate}), seeded with `torch.manual_seed({setup.seed})` before it is built;
{data_line}; global batch {setup.batch} ({per_process}),
{setup.steps} steps, AdamW lr {setup.learning_rate:g}, betas (0.9, {setup.adam_beta2}),
weight decay {setup.weight_decay:g}, grad clip {setup.grad_clip:g}, {setup.warmup_steps} warmup
steps then cosine to 10 % of the peak.

- **kubellm.train**: `python -m kubellm.train --config <json>` (save_model false, no
  checkpoints, one eval batch at the end, outside the measured steps); its AdamW is the
  engine's choice for DDP, `torch.optim.AdamW(fused=True)`.
- **HF Trainer** (`bench/peers/hf_trainer.py`): `transformers.Trainer` with
  `TrainingArguments(per_device_train_batch_size={setup.batch // setup.nproc},
  max_steps={setup.steps}, optim="adamw_torch_fused" (torch.optim.AdamW(fused=True)),
  adam_beta1/adam_beta2/adam_epsilon/weight_decay as above, lr_scheduler_type=
  "cosine_with_min_lr" (min_lr_rate 0.1), max_grad_norm, logging_steps={setup.log_every},
  save_strategy="no", report_to="none", dataloader_num_workers=0, use_cpu on CPU,
  ddp_find_unused_parameters=False)`, otherwise its defaults (its AdamW has two parameter
  groups, biases and norm weights without weight decay: the same at weight decay 0); rows
  from the same Parquet shards as a torch Dataset, labels -100 where loss_mask is 0, in the
  Trainer's own order.
- **minimal DDP loop** (`bench/peers/ddp_loop.py`): init_process_group, new_llama, DDP,
  `torch.optim.AdamW(fused=True)` (the engine's), LambdaLR with the same schedule; per
  step: the rank's rows of the global batch (a seeded permutation per epoch, the engine's
  order), forward with labels, backward, clip_grad_norm_, step, zero_grad; nothing else.

What each contender actually built and ran with, as it reports it (kubellm.train: a
one-step probe run of the engine's CLI before the measured runs, `bench/peers/engine_probe.py`;
the peers: a `bench_setup` line after their measured steps); "initial weights" is a hash of
the parameters before the first step:

{settings_table(settings)}
{gpu_figures(setup, runs, gpu)}
## Machine

| | |
|---|---|
{machine}
"""
    return table, md, rat


# --- main --------------------------------------------------------------------------------

FULL = {
    "steps": 400,
    "skip": 40,
    "log_every": 20,
    "batch": 64,
    "seq_len": 32,
    "num_records": 20000,
    "hidden": 128,
    "layers": 3,
    "heads": 4,
    "intermediate": 256,
    "repeats": 3,
    "timeout": 900.0,
}
QUICK = {
    "steps": 24,
    "skip": 8,
    "log_every": 4,
    "batch": 16,
    "seq_len": 32,
    "num_records": 1000,
    "hidden": 32,
    "layers": 1,
    "heads": 2,
    "intermediate": 64,
    "repeats": 1,
    "timeout": 180.0,
}
# What every preset that does not say otherwise uses (the CPU bench's settings).
BASE = {
    "vocab": 512,
    "grad_accum": 1,
    "corpus_mb": 0.0,
    "learning_rate": 3e-3,
    "warmup_steps": 20,
    "batch_per_gpu": 0,  # > 0: the global batch is this x nproc (when --batch is not given)
}
# About 1.1B parameters, shaped like Llama 3.2 1B but with full multi-head attention
# (ModelConfig has no num_key_value_heads): 2048 wide, 16 layers, 16 heads of 128, MLP 8192,
# tied embeddings; a 32,000-token BPE trained on the generated corpus; 2,048-token rows.
GPU_1B = {
    "steps": 60,
    "skip": 20,
    "log_every": 10,
    "batch": None,
    "batch_per_gpu": 8,
    "grad_accum": 2,
    "seq_len": 2048,
    "num_records": 0,
    "corpus_mb": 32.0,
    "vocab": 32000,
    "hidden": 2048,
    "layers": 16,
    "heads": 16,
    "intermediate": 8192,
    "learning_rate": 3e-4,
    "warmup_steps": 10,
    "repeats": 3,
    "timeout": 1800.0,
}
PRESETS: dict[str, dict[str, Any]] = {"cpu": FULL, "cpu-quick": QUICK, "gpu-1b": GPU_1B}


def resolve_device(device: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_preset(preset: str, quick: bool, device: str) -> str:
    """`--preset` as asked; `auto`: cpu-quick with --quick, gpu-1b on GPUs, else cpu."""
    if preset != "auto":
        return preset
    if quick:
        return "cpu-quick"
    return "gpu-1b" if device == "cuda" else "cpu"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--preset",
        choices=("auto", *PRESETS),
        default="auto",
        help="sizes: cpu (the CPU bench), cpu-quick (--quick), gpu-1b (a ~1.1B Llama, seq "
        "2048, every GPU); auto: gpu-1b on GPUs, else cpu (cpu-quick with --quick)",
    )
    ap.add_argument("--repeats", type=int, help="interleaved rounds (default 3; quick 1)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 400)")
    ap.add_argument("--skip", type=int, help="warmup steps left out (multiple of log-every)")
    ap.add_argument("--log-every", type=int, help="kubellm's metric window (default 20)")
    ap.add_argument("--batch", type=int, help="global batch, sequences (default 64)")
    ap.add_argument("--grad-accum", type=int, help="micro-batches per step (default 1)")
    ap.add_argument("--seq-len", type=int, help="dataset sequence length (default 32)")
    ap.add_argument("--num-records", type=int, help="synthetic records (default 20000)")
    ap.add_argument("--corpus-mb", type=float, help="MiB of generated text instead (gpu-1b: 32)")
    ap.add_argument("--hidden", type=int, help="model width (default 128)")
    ap.add_argument("--layers", type=int, help="decoder layers (default 3)")
    ap.add_argument("--heads", type=int, help="attention heads (default 4)")
    ap.add_argument("--intermediate", type=int, help="MLP width (default 256)")
    ap.add_argument("--learning-rate", type=float, help="peak AdamW lr (default 3e-3)")
    ap.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 20)")
    ap.add_argument("--timeout", type=float, help="seconds per torchrun run before it is killed")
    ap.add_argument("--vocab", type=int, help="BPE vocabulary asked of prepare (default 512)")
    ap.add_argument(
        "--nproc", type=int, help="processes (default 2; GPUs: all of them, cpu preset: <= 2)"
    )
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS per process (CPUs / nproc)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/benchmarks-train.md", help="markdown report")
    ap.add_argument("--json", default="", help="also write the figures as JSON here")
    ap.add_argument("--cache-dir", default="runs/bench", help="dataset cache and scratch")
    ap.add_argument("--quick", action="store_true", help="tiny model and steps, 1 repeat")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the setup, the TrainConfig and the model's size, and run nothing (no "
        "GPU needed: give --nproc for --device cuda on a machine without one)",
    )
    args = ap.parse_args(argv)
    args.device = resolve_device(args.device)
    args.preset = pick_preset(args.preset, args.quick, args.device)
    values = {**BASE, **PRESETS[args.preset]}
    for name, value in values.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.skip % args.log_every or not 0 < args.skip < args.steps:
        ap.error("--skip must be a multiple of --log-every and less than --steps")
    if args.steps % args.log_every:
        ap.error("--steps must be a multiple of --log-every (whole metric windows)")
    if args.preset == "gpu-1b" and args.device != "cuda":
        ap.error("--preset gpu-1b runs on GPUs: --device cuda (no GPU is visible here)")
    if args.corpus_mb < 0 or (not args.corpus_mb and args.num_records < 100):
        ap.error("--num-records must be >= 100 (or give --corpus-mb)")
    return args


def make_setup(args: argparse.Namespace) -> Setup:
    import torch

    device = resolve_device(args.device)
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if args.nproc:
        nproc = args.nproc
    elif device == "cpu":
        nproc = 2
    elif args.preset == "gpu-1b":
        nproc = gpus  # every GPU of the node
    else:
        nproc = min(2, gpus)  # the CPU model on GPUs, as before the GPU preset
    if nproc < 1:
        raise SystemExit("no GPU visible: give --nproc (with --dry-run) or --device cpu")
    precision = args.precision
    if precision == "auto":
        bf16 = device == "cuda" and (args.dry_run or torch.cuda.is_bf16_supported())
        precision = "bf16" if bf16 else "fp32"
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // nproc)
    batch = args.batch or args.batch_per_gpu * nproc
    if batch % (nproc * args.grad_accum):
        raise SystemExit(
            f"--batch {batch} must be divisible by {nproc} processes x {args.grad_accum} "
            "micro-batches (--grad-accum)"
        )
    return Setup(
        steps=args.steps,
        skip=args.skip,
        log_every=args.log_every,
        batch=batch,
        seq_len=args.seq_len,
        num_records=args.num_records,
        vocab=args.vocab,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        intermediate=args.intermediate,
        nproc=nproc,
        device=device,
        precision=precision,
        threads=threads,
        seed=args.seed,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        grad_accum=args.grad_accum,
        corpus_mb=args.corpus_mb,
        preset=args.preset,
    )


class _Vocab:
    """Stands in for a tokenizer where only its size and special ids matter (the dry run)."""

    bos_token_id = eos_token_id = 0
    pad_token_id = 1

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def model_params(setup: Setup, vocab: int | None = None) -> int:
    """Parameters of the bench's model (built on the meta device: no memory, no init)."""
    import torch

    from kubellm.config import ModelConfig
    from kubellm.train.model import new_llama

    cfg = ModelConfig(**train_config_model(setup))
    with torch.device("meta"):
        model = new_llama(cfg, _Vocab(vocab or setup.vocab))  # type: ignore[arg-type]
    return sum(p.numel() for p in model.parameters())


def train_config_model(setup: Setup) -> dict[str, Any]:
    return dict(train_config(setup, Path("dataset"), Path("model"))["model"])


def dry_run(setup: Setup) -> int:
    """What the bench would run, printed: the setup, the TrainConfig, the model's size."""
    cfg = train_config(setup, Path("<dataset>"), Path("<scratch>/model"))
    params = model_params(setup)
    micro = setup.batch // setup.nproc // setup.grad_accum
    print(
        f"preset {setup.preset}: {setup.nproc} x {setup.device} ({setup.precision}), "
        f"global batch {setup.batch} x {setup.seq_len} tokens = {setup.tokens_per_step:,} "
        f"tokens per step ({setup.grad_accum} micro-batch(es) of {micro} per process), "
        f"{setup.steps} steps (first {setup.skip} skipped)\n"
        f"model: {params:,} parameters with a {setup.vocab:,}-token vocabulary "
        "(the prepared BPE's size is used when it runs)\n"
        "data: "
        + (
            f"a generated {setup.corpus_mb:g} MiB corpus (bench/corpus.py), BPE {setup.vocab}"
            if setup.corpus_mb
            else f"{setup.num_records:,} synthetic records, BPE {setup.vocab}"
        )
        + f", rows of {setup.seq_len}\nTrainConfig:\n{json.dumps(cfg, indent=2)}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cmd = shlex.join(
        ["python", "-m", "bench.train_bench", *(sys.argv[1:] if argv is None else argv)]
    )
    setup = make_setup(args)
    if args.dry_run:
        return dry_run(setup)
    cache = Path(args.cache_dir).resolve()
    work = cache / "work"
    work.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    dataset_dir = ensure_dataset(cache, setup)
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    scratch = Path(tempfile.mkdtemp(dir=work, prefix="train-"))
    try:
        config = scratch / "train.json"
        cfg = train_config(setup, dataset_dir, scratch / "model")
        config.write_text(json.dumps(cfg, indent=2))
        print(
            f"dataset: {dataset_dir} ({manifest['rows']['train']:,} rows x {setup.seq_len})\n"
            f"setup: {setup.nproc} x {setup.device} ({setup.precision}, {setup.threads} "
            f"thread(s)), batch {setup.batch}, {setup.steps} steps (first {setup.skip} "
            f"skipped), {args.repeats} interleaved repeat(s)",
            flush=True,
        )
        info = machine_info(setup)  # before the runs: the engine source they ran (git HEAD)
        engine = describe_engine(setup, config, args.timeout)
        load_start = _load()
        runs = measure(setup, config, work, args.repeats, args.timeout)
        load_end = _load()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    settings = contender_settings(runs, engine)
    gpu = gpu_peak_of(setup, runs, device_name(setup))
    table, md, rat = report(setup, runs, info, cmd, manifest, (load_start, load_end), settings, gpu)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    if args.json:
        figures: dict[str, Any] = {
            "setup": dataclasses.asdict(setup),
            "ratios": rat,
            "runs": [dataclasses.asdict(r) for r in runs],
            "config": cfg,
            "contenders": settings,
        }
        if setup.device == "cuda":
            figures["gpu"] = dataclasses.asdict(gpu) if gpu is not None else None
            figures["mfu"] = {
                f"{r.contender}/{r.repeat}": mfu_of(r, r, gpu) if gpu else None for r in runs
            }
        Path(args.json).write_text(json.dumps(figures, indent=2))
    print()
    print(settings_table(settings))
    print()
    print(table)
    for r in runs:
        if r.contender == "kubellm" and r.mfu is not None:
            print(f"kubellm mfu (run {r.repeat}): {r.mfu:.1%}")
    if setup.device == "cuda":
        print(gpu_figures(setup, runs, gpu))
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    ok = all(x["pass"] for x in rat.values())
    return 1 if args.check and not ok else 0


def device_name(setup: Setup) -> str | None:
    if setup.device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    raise SystemExit(main())
