"""Benchmark of prepare_data (issues 3 and 8): throughput against two references, and memory.

On each corpus (`--corpus clean|messy|both`, default both), in one run, interleaved, best of
`--repeats`:

1. prepare_data end to end (JSONL -> clean -> dedup -> tokenize -> pack -> Parquet) against
   the floor: the fastest tokenizer call over the kept texts, already in memory. The fast
   tokenizer has two batch calls, `encode_batch` and `encode_batch_fast` (the same ids
   without character offsets); both are timed, a check run compares their ids, and the
   floor is the faster of those that give `encode_batch`'s ids. Target: ours >= 0.85 x floor.
2. prepare_data against a `datasets` peer: `load_dataset("json")`, `.map(batched=True)` with
   the same tokenizer as a PreTrainedTokenizerFast, the same concatenate-with-EOS-and-chunk
   packing (numpy), Parquet out, timed from the JSONL file; target: ours >= 1.3 x peer.
3. Peak memory (VmHWM) of a fresh process running prepare on `--scale` x the input against
   1 x; target: <= 1.25.

The corpora (bench/corpus.py): "clean" is English-like text that is already normalized;
"messy" is long, irregularly formatted documents (docstring- and README-like: indentation,
tabs, CRLF, mixed Unicode forms, control characters, filtered and near-identical documents),
so prepare's normalization and filters do real work. Each corpus gets its own byte-level BPE
(vocab 8192) trained once on a sample of it and cached, so tokenizer training is not what is
measured. Throughput is reported as reference tokens per second: the number of token ids
encode_batch produces for the kept documents, divided by each contender's wall time, so the
ratios are ratios of times on identical work.

    python -m bench.prepare_bench [--corpus both] [--size-mb 20] [--scale 10] [--repeats 3]
    python -m bench.prepare_bench --quick --out /tmp/bench.md      # the smoke test's size
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the peer reads local files only
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.corpus import KINDS, MIB, Corpus, ensure_corpus, kept_texts
from bench.machine import machine_info as base_machine_info

REPO = Path(__file__).resolve().parents[1]
VOCAB = 8192
SEQ_LEN = 1024
SHARD_ROWS = 65_536
TOKENIZER_SAMPLE_MIB = 4.0
CHILD_TAG = "BENCH_CHILD "
TARGET_FLOOR = 0.85  # ours / the fastest tokenizer call with encode_batch's ids, at least
# Issue 21: on the short-record (instruction/chat-like) corpus, in process, at least.
TARGET_FLOOR_SHORT = 0.9
# The start-up probe: `kubellm prepare` on the corpus's first kept records, at least this many
# and this many characters (enough for a row of seq_len in each split), so its wall time is
# the process's fixed cost (interpreter, imports, config, tokenizer load, exit).
# The short corpus is sized from --size-mb (20 MiB: 80 MiB, about 120k records); its peak
# memory is not measured (issue 3's memory target is on the clean corpus; a 10x short corpus
# would be 800 MiB to generate).
SHORT_SIZE_FACTOR = 4.0
MEMORY_CORPORA = ("clean", "messy")
STARTUP_RECORDS = 200
STARTUP_CHARS = 256 * 1024
TARGET_PEER = 1.3  # ours / datasets.map + packing, at least
# Issue 3 set the peer and memory targets on the clean corpus; on the messy one (issue 8
# asks for the floor target there) both are reported for information: the peer does no
# normalization or filtering, and its time is nearly all the tokenizer's, which both sides
# share; the memory ratio is reported as measured.
ISSUE3_TARGET_CORPORA = ("clean",)
TARGET_MEMORY = 1.25  # peak RSS at scale x / at 1 x, at most


# --- the call under test -------------------------------------------------------------------


def run_prepare(source: Path, out_dir: Path, tokenizer_dir: Path) -> tuple[dict[str, Any], str]:
    """Run prepare_data once; returns its manifest and how it got its tokenizer.

    The one place that knows PrepareParams: adjust here when its fields change. Fields the
    current PrepareParams lacks are left out (an older prepare trains its own BPE of
    VOCAB; that training is then part of its measured time, and the report says so).
    """
    from kubellm.data.prepare import PrepareParams, prepare

    fields = {f.name for f in dataclasses.fields(PrepareParams)}
    kw: dict[str, Any] = {
        "source": str(source),
        "text_field": "text",
        "seq_len": SEQ_LEN,
        "vocab_size": VOCAB,
        "shard_rows": SHARD_ROWS,
    }
    mode = "trained by prepare (vocab 8192), inside the measured time"
    if "tokenizer" in fields:
        kw["tokenizer"] = str(tokenizer_dir)
        mode = "the benchmark's fixed BPE, passed as tokenizer="
    # `format` is left at its default (detection from the .jsonl suffix); set it here if needed.
    kw = {k: v for k, v in kw.items() if k in fields}
    return prepare(PrepareParams(**kw), out_dir), mode


# --- the references ------------------------------------------------------------------------


def _tokenizer(tokenizer_dir: Path) -> Any:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def run_floor(tokenizer_dir: Path, texts: list[str], batch: int, fast: bool = False) -> int:
    """encode_batch (fast: encode_batch_fast) over texts already in memory; the number of ids."""
    tok = _tokenizer(tokenizer_dir)
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    n = 0
    for i in range(0, len(texts), batch):
        n += sum(len(e) for e in encode(texts[i : i + batch], add_special_tokens=False))
    return n


def kubellm_command() -> list[str]:
    """How a user runs `kubellm`: the console script beside this interpreter, else -m."""
    script = Path(sys.executable).with_name("kubellm")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kubellm.cli"]


def run_cli(source: Path, tokenizer_dir: Path, work: Path) -> dict[str, Any]:
    """The whole `kubellm prepare` process, timed from its start to its exit (issue 21).

    The same PrepareParams as run_prepare, through the CLI's `--set` parameters. Its wall
    time includes everything a user waits for: the interpreter, the imports, the config,
    the tokenizer load, the run and the exit; "prepare_seconds" is prepare's own counter.
    """
    out_dir = Path(tempfile.mkdtemp(dir=work, prefix="cli-"))
    cmd = [*kubellm_command(), "prepare", str(out_dir / "dataset")]
    for key, value in (
        ("data_source", source),
        ("tokenizer", tokenizer_dir),
        ("text_field", "text"),
        ("seq_len", SEQ_LEN),
        ("vocab_size", VOCAB),
    ):
        cmd += ["--set", f"{key}={value}"]
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            err = proc.stderr[-4000:]
            raise RuntimeError(f"kubellm prepare failed ({proc.returncode}):\n{err}")
        manifest = json.loads((out_dir / "dataset" / "manifest.json").read_text())
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "tokens": manifest["tokens"]["train"] + manifest["tokens"]["val"],
        "prepare_seconds": manifest["seconds"],
        "kept": manifest["records"]["kept"],
    }


def startup_source(corpus: Corpus, work: Path) -> Path:
    """The start-up probe's input: the corpus's first kept records (see STARTUP_RECORDS)."""
    path = work / f"startup-{corpus.kept_path.name}"
    if not path.is_file():
        lines, chars = [], 0
        with open(corpus.kept_path, encoding="utf-8") as fh:
            for line in fh:
                lines.append(line)
                chars += len(line)
                if len(lines) >= STARTUP_RECORDS and chars >= STARTUP_CHARS:
                    break
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(lines), encoding="utf-8")
        os.replace(tmp, path)
    return path


def check_ids(tokenizer_dir: Path, texts: list[str], batch: int) -> dict[str, Any]:
    """Whether encode_batch_fast gives encode_batch's ids, document by document (untimed)."""
    import hashlib

    tok = _tokenizer(tokenizer_dir)
    same, tokens, h = True, 0, hashlib.blake2b(digest_size=16)
    for i in range(0, len(texts), batch):
        chunk = texts[i : i + batch]
        slow = tok.encode_batch(chunk, add_special_tokens=False)
        fast = tok.encode_batch_fast(chunk, add_special_tokens=False)
        for a, b in zip(slow, fast, strict=True):
            ids = a.ids
            same = same and ids == b.ids
            tokens += len(ids)
            h.update(
                len(ids).to_bytes(4, "little") + b"".join(x.to_bytes(4, "little") for x in ids)
            )
    return {"same_ids": same, "tokens": tokens, "ids_blake2b": h.hexdigest()}


def pack_numpy(values: Any, lengths: Any, eos: int, seq_len: int) -> Any:
    """Concatenate documents with an EOS after each and chunk to seq_len rows (int32)."""
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths + 1) - 1  # where each document's EOS goes
    flat = np.empty(int(lengths.sum()) + len(lengths), dtype=np.int32)
    body = np.ones(len(flat), dtype=bool)
    body[ends] = False
    flat[body] = values
    flat[ends] = eos
    rows = len(flat) // seq_len
    return flat[: rows * seq_len].reshape(rows, seq_len)


def run_peer(jsonl: Path, tokenizer_dir: Path, work: Path) -> int:
    """datasets load_dataset("json") + map(batched=True) + numpy packing + Parquet.

    num_proc is left at None: the fast tokenizer's batch call already runs on every core
    (Rust threads), and num_proc=2 on two cores trades those threads for two processes
    that each tokenize single-threaded, plus forking and Arrow cache merging.
    """
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    eos = tok.eos_token_id
    assert eos is not None
    ds = datasets.load_dataset(
        "json", data_files=str(jsonl), split="train", cache_dir=str(work / "hf-cache")
    )
    ds = ds.map(
        lambda b: tok(b["text"], add_special_tokens=False, return_attention_mask=False),
        batched=True,
        remove_columns=ds.column_names,
    )
    ids = ds.data.column("input_ids").combine_chunks()
    values = pc.list_flatten(ids).to_numpy()
    lengths = pc.list_value_length(ids).to_numpy()
    rows = pack_numpy(values, lengths, eos, SEQ_LEN)
    out = work / "peer"
    out.mkdir(parents=True, exist_ok=True)
    for i in range(0, max(len(rows), 1), SHARD_ROWS):
        chunk = rows[i : i + SHARD_ROWS]
        offsets = np.arange(0, chunk.size + 1, SEQ_LEN, dtype=np.int32)
        col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(chunk.reshape(-1)))
        pq.write_table(
            pa.table({"input_ids": col}),
            out / f"shard-{i // SHARD_ROWS:05d}.parquet",
            compression="zstd",
        )
    return int(len(values) + len(lengths))


# --- fixtures ------------------------------------------------------------------------------


def ensure_tokenizer(cache_dir: Path, corpus: Corpus, seed: int) -> Path:
    """A byte-level BPE of VOCAB trained on the corpus's first few MiB, cached."""
    sample: list[str] = []
    size = 0
    for text in kept_texts(corpus):
        sample.append(text)
        size += len(text)
        if size >= TOKENIZER_SAMPLE_MIB * MIB:
            break
    kind = "" if corpus.kind == "clean" else f"-{corpus.kind}"
    path = cache_dir / f"tokenizer-bpe{VOCAB}{kind}-seed{seed}-docs{len(sample)}"
    if (path / "tokenizer.json").is_file():
        return path
    from kubellm.data.tokenizer import train_bpe

    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tok-"))
    train_bpe(sample, VOCAB).save_pretrained(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _quiet(fn: Callable[[], Any]) -> Any:
    """Call fn with its stdout/stderr captured (replayed if it raises)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            return fn()
    except BaseException:
        sys.stderr.write(buf.getvalue())
        raise


# --- the child processes -------------------------------------------------------------------
#
# Every timed run and every memory measurement runs in a fresh process: a run that follows
# another in the same interpreter inherits its heap and thread pools (prepare_data measured
# 15-25 % slower right after a datasets run in the same process).


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB


def warm_imports(tokenizer_dir: Path) -> None:
    """Import what the contenders import (loading the tokenizer pulls in torch), untimed."""
    import datasets  # noqa: F401
    import numpy  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    from transformers import AutoTokenizer

    import kubellm.data.prepare  # noqa: F401

    _quiet(lambda: AutoTokenizer.from_pretrained(str(tokenizer_dir)))


def child_main(args: argparse.Namespace) -> int:
    """One run in this fresh process; prints its figures as one tagged JSON line.

    memory: prepare_data alone after importing kubellm (its peak RSS is the figure);
    ours, floor, floor_fast, peer: one timed run after the imports (and, for the floors, the
    texts); ids: the untimed check that encode_batch_fast gives encode_batch's ids.
    """
    tok_dir, out_dir = Path(args.tokenizer_dir), Path(args.out_dir)
    result: dict[str, Any] = {}
    if args.child == "ids":
        result = check_ids(tok_dir, kept_texts(Path(args.source)), args.floor_batch)
        print(CHILD_TAG + json.dumps(result), flush=True)
        return 0
    if args.child == "memory":
        import kubellm.data.prepare  # noqa: F401  (imports count in the baseline, not the run)

        result["baseline_kib"] = _proc_status_kib("VmRSS")
    else:
        warm_imports(tok_dir)
    texts = kept_texts(Path(args.source)) if args.child in ("floor", "floor_fast") else []
    t0, c0 = time.perf_counter(), _cpu_seconds()
    if args.child in ("memory", "ours"):
        manifest, mode = _quiet(lambda: run_prepare(Path(args.source), out_dir, tok_dir))
        tokens = manifest["tokens"]["train"] + manifest["tokens"]["val"]
        result.update(
            kept=manifest["records"]["kept"],
            dropped=manifest["records"]["dropped"],
            tokenizer_mode=mode,
        )
    elif args.child in ("floor", "floor_fast"):
        tokens = run_floor(tok_dir, texts, args.floor_batch, fast=args.child == "floor_fast")
    elif args.child == "peer":
        tokens = _quiet(lambda: run_peer(Path(args.source), tok_dir, out_dir))
    else:
        raise SystemExit(f"unknown child {args.child!r}")
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    result.update(seconds=seconds, cpu_seconds=cpu, tokens=tokens)
    result["vmhwm_kib"] = _proc_status_kib("VmHWM")
    print(CHILD_TAG + json.dumps(result), flush=True)
    return 0


def _cpu_seconds() -> float:
    """CPU time of this process, every thread, user and system."""
    t = os.times()
    return t.user + t.system


def run_child(kind: str, source: Path, tokenizer_dir: Path, work: Path, floor_batch: int) -> Any:
    """Run `python -m bench.prepare_bench --child KIND ...`; returns its figures."""
    out_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"{kind}-"))
    cmd = [sys.executable, "-m", "bench.prepare_bench", "--child", kind, "--source", str(source)]
    cmd += ["--tokenizer-dir", str(tokenizer_dir), "--out-dir", str(out_dir)]
    cmd += ["--floor-batch", str(floor_batch)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(CHILD_TAG))
    return json.loads(line[len(CHILD_TAG) :])


# --- the run -------------------------------------------------------------------------------


@dataclasses.dataclass
class Runs:
    name: str
    seconds: list[float] = dataclasses.field(default_factory=list)
    cpu_seconds: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0  # the contender's own count (ours: the manifest's; peer: ids + EOS)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cores(self) -> float:
        """CPU seconds over wall seconds, median over the runs: the cores kept busy."""
        return statistics.median(c / s for c, s in zip(self.cpu_seconds, self.seconds, strict=True))


@dataclasses.dataclass
class Throughput:
    ours: Runs
    batch: Runs  # encode_batch
    fast: Runs  # encode_batch_fast
    peer: Runs
    ids: dict[str, Any]  # check_ids: does encode_batch_fast give encode_batch's ids?
    last_ours: dict[str, Any]
    cli: Runs  # the whole `kubellm prepare` process, from its start to its exit
    startup: Runs  # the same on the start-up probe (a few hundred records): the fixed cost
    last_cli: dict[str, Any]

    @property
    def all_runs(self) -> tuple[Runs, ...]:
        return (self.ours, self.batch, self.fast, self.peer, self.cli, self.startup)

    @property
    def floor(self) -> Runs:
        """The fastest tokenizer call that gives encode_batch's ids."""
        if self.ids["same_ids"] and self.fast.best < self.batch.best:
            return self.fast
        return self.batch


def measure_throughput(
    corpus: Corpus, tokenizer_dir: Path, work: Path, repeats: int, floor_batch: int, label: str
) -> Throughput:
    ids = run_child("ids", corpus.kept_path, tokenizer_dir, work, floor_batch)
    print(f"  {label}: encode_batch_fast gives encode_batch's ids: {ids['same_ids']}", flush=True)
    runs = {
        "ours": Runs("prepare_data"),
        "floor": Runs("encode_batch"),
        "peer": Runs("datasets.map"),
        "floor_fast": Runs("encode_batch_fast"),
        "cli": Runs("kubellm prepare (process)"),
        "startup": Runs("kubellm prepare (start-up probe)"),
    }
    probe = startup_source(corpus, work)
    last: dict[str, Any] = {}
    last_cli: dict[str, Any] = {}
    kinds = list(runs)
    for r in range(repeats):  # interleaved; the order rotates so no one always goes first
        k = r % len(kinds)
        for kind in kinds[k:] + kinds[:k]:
            source = corpus.path if kind in ("ours", "cli") else corpus.kept_path
            if kind == "cli":
                result = last_cli = run_cli(source, tokenizer_dir, work)
            elif kind == "startup":
                result = run_cli(probe, tokenizer_dir, work)
            else:
                result = run_child(kind, source, tokenizer_dir, work, floor_batch)
            runs[kind].seconds.append(result["seconds"])
            runs[kind].cpu_seconds.append(result["cpu_seconds"])
            runs[kind].tokens = result["tokens"]
            if kind == "ours":
                last = result
        print(
            f"  {label} repeat {r + 1}/{repeats}: "
            + ", ".join(f"{x.name} {x.seconds[-1]:.2f}s" for x in runs.values()),
            flush=True,
        )
    return Throughput(
        runs["ours"],
        runs["floor"],
        runs["floor_fast"],
        runs["peer"],
        ids,
        last,
        runs["cli"],
        runs["startup"],
        last_cli,
    )


def machine_info() -> dict[str, str]:
    return base_machine_info(
        ("torch", "tokenizers", "transformers", "pyarrow", "datasets", "numpy")
    )


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "nan"


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _floor_target(kind: str) -> float:
    return TARGET_FLOOR_SHORT if kind == "short" else TARGET_FLOOR


def _peer_target(kind: str) -> str:
    return f"≥ {TARGET_PEER}" if kind in ISSUE3_TARGET_CORPORA else "none (information)"


def _peer_verdict(kind: str, ratio: float) -> str:
    return _verdict(ratio >= TARGET_PEER) if kind in ISSUE3_TARGET_CORPORA else "—"


def _memory_target(kind: str) -> str:
    return f"≤ {TARGET_MEMORY}" if kind in ISSUE3_TARGET_CORPORA else "none (information)"


def _memory_verdict(kind: str, ratio: float) -> str:
    return _verdict(ratio <= TARGET_MEMORY) if kind in ISSUE3_TARGET_CORPORA else "—"


def _per_repeat(ours: Runs, ref: Runs) -> list[float]:
    return [b / a for a, b in zip(ours.seconds, ref.seconds, strict=True)]


def _list(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


@dataclasses.dataclass
class Measured:
    """One corpus's figures: throughput at 1x, peak memory at 1x and scale x."""

    small: Corpus
    big: Corpus | None  # None: memory not measured (the short corpus)
    tp: Throughput
    mem1: dict[str, Any] | None
    mem_n: dict[str, Any] | None

    def ratios(self) -> dict[str, float]:
        tp = self.tp
        memory = math.nan
        if self.mem1 is not None and self.mem_n is not None:
            memory = self.mem_n["vmhwm_kib"] / self.mem1["vmhwm_kib"]
        return {
            "floor": tp.floor.best / tp.ours.best,
            "peer": tp.peer.best / tp.ours.best,
            "memory": memory,
            "process": tp.floor.best / tp.cli.best,  # the whole `kubellm prepare` process
            "startup_s": tp.startup.best,
        }

    @property
    def floor_ok(self) -> bool:
        return self.ratios()["floor"] >= _floor_target(self.small.kind)


def corpus_section(args: argparse.Namespace, m: Measured) -> tuple[str, str]:
    """(the results table, the markdown section) of one corpus."""
    tp, small, big = m.tp, m.small, m.big
    ours, floor, peer = tp.ours, tp.floor, tp.peer
    ref = tp.batch.tokens  # reference tokens: ids encode_batch gives the kept documents
    ratios = m.ratios()
    s = args.scale

    def rate(runs: Runs) -> float:
        return ref / runs.best

    target = _floor_target(small.kind)
    rows = [
        "| metric | ours | peer | ratio | target | result |",
        "|---|---:|---:|---:|---|---|",
        f"| throughput vs tokenizer floor, `{floor.name}` (tokens/s) | {_fmt(rate(ours))} "
        f"| {_fmt(rate(floor))} | {ratios['floor']:.2f} | ≥ {target} "
        f"| {_verdict(ratios['floor'] >= target)} |",
        f"| whole `kubellm prepare` process vs tokenizer floor (tokens/s) "
        f"| {_fmt(rate(tp.cli))} | {_fmt(rate(floor))} | {ratios['process']:.2f} "
        f"| none (information) | — |",
        f"| throughput vs `datasets.map` + packing (tokens/s) | {_fmt(rate(ours))} "
        f"| {_fmt(rate(peer))} | {ratios['peer']:.2f} | {_peer_target(small.kind)} "
        f"| {_peer_verdict(small.kind, ratios['peer'])} |",
    ]
    if m.mem1 is not None and m.mem_n is not None:
        peak1, peak_n = m.mem1["vmhwm_kib"] / 1024, m.mem_n["vmhwm_kib"] / 1024
        rows.append(
            f"| peak RSS, {s:g}× input (ours) vs 1× input (peer), MiB | {_fmt(peak_n)} "
            f"| {_fmt(peak1)} | {ratios['memory']:.2f} | {_memory_target(small.kind)} "
            f"| {_memory_verdict(small.kind, ratios['memory'])} |"
        )
    table = "\n".join(rows)
    n = len(ours.seconds)
    header = " | ".join(f"run {i + 1}" for i in range(n))
    runs_rows = []
    for runs in (ours, tp.batch, tp.fast, peer, tp.cli, tp.startup):
        cells = " | ".join(f"{x:.2f}" for x in runs.seconds)
        runs_rows.append(
            f"| {runs.name} | {cells} | {runs.best:.2f} | {runs.median:.2f} "
            f"| {_fmt(rate(runs))} | {runs.cores:.2f} | {runs.tokens:,} |"
        )
    paired = [
        f"vs the floor ({floor.name}) {_list(_per_repeat(ours, floor))}",
        f"vs encode_batch {_list(_per_repeat(ours, tp.batch))}"
        if floor is not tp.batch
        else f"vs encode_batch_fast {_list(_per_repeat(ours, tp.fast))}",
        f"vs datasets.map {_list(_per_repeat(ours, peer))}",
        f"the `kubellm prepare` process vs the floor {_list(_per_repeat(tp.cli, floor))}",
    ]
    checks = []
    kept = tp.last_ours["kept"]
    checks.append(
        f"prepare kept {kept:,} of {small.records:,} records"
        + (
            " (the generator's count)"
            if kept == small.kept
            else f" — **the generator expects {small.kept:,}**; the floor and the peer "
            "tokenize the generator's set"
        )
    )
    if small.dropped:
        same = tp.last_ours["dropped"] == small.dropped
        dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(tp.last_ours["dropped"].items()))
        checks.append(
            f"dropped by reason: {dropped}"
            + (
                " (as the generator expects)"
                if same
                else f" — **the generator expects {small.dropped}**"
            )
        )
    eos_ok = ours.tokens == ref + kept
    checks.append(
        f"prepare's token count {ours.tokens:,} = the reference {ref:,} + one EOS per kept "
        f"document: {'yes' if eos_ok else '**no**'}"
    )
    same_ids = tp.ids["same_ids"]
    checks.append(
        "`encode_batch_fast` gives `encode_batch`'s ids, document by document: "
        + ("yes" if same_ids else "**no** (so the floor is `encode_batch`)")
        + f" ({tp.ids['tokens']:,} ids, blake2b {tp.ids['ids_blake2b'][:16]})"
    )
    cli = tp.last_cli
    process = (
        f"The whole `kubellm prepare` process (`{shlex.join(['kubellm', 'prepare', 'OUT'])} "
        "--set data_source=... --set tokenizer=...`, the same parameters) took "
        f"{tp.cli.best:.2f} s best from its start to its exit, {cli['prepare_seconds']:.2f} s "
        "of it by prepare's own counter (which starts before the tokenizer is loaded): "
        f"{ratios['process']:.2f} × the floor. The start-up probe, the same command on the "
        f"corpus's first {STARTUP_RECORDS}+ kept records, took {tp.startup.best:.2f} s best: "
        "the process's fixed cost (interpreter, imports, config, tokenizer, exit)."
    )
    memory = "Peak memory is not measured on this corpus (issue 3's target is on the clean one)."
    if m.mem1 is not None and m.mem_n is not None and big is not None:
        mem_rows = []
        for label, c, mm in (("1×", small, m.mem1), (f"{s:g}×", big, m.mem_n)):
            mem_rows.append(
                f"| {label} | {c.size_bytes / MIB:,.1f} | {c.records:,} | {mm['kept']:,} "
                f"| {mm['vmhwm_kib'] / 1024:,.0f} | {mm['baseline_kib'] / 1024:,.0f} "
                f"| {mm['seconds']:.1f} | {_fmt(mm['tokens'] / mm['seconds'])} |"
            )
        g1 = (m.mem1["vmhwm_kib"] - m.mem1["baseline_kib"]) / 1024
        gn = (m.mem_n["vmhwm_kib"] - m.mem_n["baseline_kib"]) / 1024
        memory = f"""| input | MiB | records | kept | peak RSS (VmHWM), MiB \
| RSS after imports, MiB | seconds | tokens/s |
|---|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(mem_rows)}

Growth above the RSS after imports: {g1:,.0f} MiB at 1×, {gn:,.0f} MiB at {s:g}× \
(ratio {gn / max(g1, 1e-9):.2f}; informational, the target is on the whole peak). The \
{s:g}× corpus ({big.size_bytes / MIB:,.1f} MiB) is generated from the same seed, not repeated."""
    body = f"""## The {small.kind} corpus

{small.size_bytes / MIB:.1f} MiB, {small.records:,} records ({small.duplicates:,} duplicates, \
{small.bad:,} bad lines); {_describe(small.kind)}

{table}

The floor is `{floor.name}`: {_why_floor(tp)}

Ratios within each repeat (runs seconds apart; a check on the machine's noise):
{"; ".join(paired)}.

{process}

Checks: {"; ".join(checks)}.

### Runs (seconds, wall)

| contender | {header} | best | median | tokens/s (best) | cores busy | own token count |
|---|{"---:|" * n}---:|---:|---:|---:|---:|
{chr(10).join(runs_rows)}

Cores busy: the process's CPU seconds (all threads) over its wall seconds, median of the runs.

### Peak memory (prepare_data in a fresh process)

{memory}
"""
    return table, body


def _describe(kind: str) -> str:
    if kind == "short":
        return (
            "instruction- and chat-like records (issue 21): a prompt (an instruction, a "
            "question, a task on a quoted sentence) and a response of one to five sentences "
            "or a short list, as `prompt\\n\\nresponse` or a `User:`/`Assistant:` "
            "transcript, median about 300 characters, each record also carrying its `prompt` "
            "and `response` fields; the clean corpus's vocabulary, already normalized; 3 % "
            "exact duplicates, 0.25 % bad lines."
        )
    if kind == "clean":
        return (
            "English-like documents of 300 to about 3000 characters from a Zipf-weighted "
            "vocabulary, already normalized (NFC, single spaces, stripped lines)."
        )
    return (
        "docstring- and README-like documents of about 2 KB to 60 KB (a few over max_chars): "
        "wrapped prose, indented code, parameter lists, tables, logs with ANSI escapes and "
        "control characters; NFC, NFD and canonical singletons mixed, compatibility "
        "characters, CJK, Hangul and emoji; tabs, CRLF, runs of spaces, trailing blanks, "
        "form feeds; whitespace-only, symbol-heavy and repeated-line documents, and "
        "documents that differ from an earlier one only in whitespace and Unicode form."
    )


def _why_floor(tp: Throughput) -> str:
    if not tp.ids["same_ids"]:
        return "`encode_batch_fast` does not give the same ids here, so it cannot be the floor."
    if tp.floor is tp.fast:
        return (
            "it gives the same ids as `encode_batch` (checked above) without computing "
            f"character offsets, and was the faster call ({tp.fast.best:.2f} s vs "
            f"{tp.batch.best:.2f} s best). prepare_data calls it too."
        )
    return (
        "`encode_batch_fast` gives the same ids but was not faster in this run "
        f"({tp.fast.best:.2f} s vs {tp.batch.best:.2f} s best)."
    )


def report(
    args: argparse.Namespace, measured: list[Measured], info: dict[str, str], command: str
) -> tuple[str, str]:
    """(the results tables, the whole markdown report)."""
    tables, sections = [], []
    for m in measured:
        table, body = corpus_section(args, m)
        tables.append(f"{m.small.kind} corpus:\n{table}")
        sections.append(body)
    machine = "\n".join(f"| {k} | {v} |" for k, v in info.items())
    kinds = " and ".join(m.small.kind for m in measured)
    commit = info.get("git HEAD", "unknown")
    summary = [
        "| corpus | metric | ratio | per repeat | target | result |",
        "|---|---|---:|---|---|---|",
    ]
    for m in measured:
        r = m.ratios()
        tp = m.tp
        summary += [
            f"| {m.small.kind} | ours / floor (`{tp.floor.name}`) | {r['floor']:.2f} "
            f"| {_list(_per_repeat(tp.ours, tp.floor))} | ≥ {_floor_target(m.small.kind)} "
            f"| {_verdict(m.floor_ok)} |",
            f"| {m.small.kind} | whole `kubellm prepare` process / floor | {r['process']:.2f} "
            f"| {_list(_per_repeat(tp.cli, tp.floor))} | none (information; start-up probe "
            f"{r['startup_s']:.2f} s) | — |",
            f"| {m.small.kind} | ours / `datasets.map` | {r['peer']:.2f} "
            f"| {_list(_per_repeat(tp.ours, tp.peer))} | {_peer_target(m.small.kind)} "
            f"| {_peer_verdict(m.small.kind, r['peer'])} |",
        ]
        if m.mem1 is not None:
            summary.append(
                f"| {m.small.kind} | peak RSS {args.scale:g}× / 1× | {r['memory']:.2f} | "
                f"| {_memory_target(m.small.kind)} "
                f"| {_memory_verdict(m.small.kind, r['memory'])} |"
            )
    n = args.repeats
    md = f"""# prepare_data benchmark

prepare_data's targets (issues 3, 8 and 21) on the {kinds} corpora, measured in one run on this
machine ({info["nproc"]} CPUs, {info["date"]}) at commit {commit}. Rerun with `make bench`, or:

```
{command}
```

## Summary

{chr(10).join(summary)}

Throughput is reference tokens per second, best of {n} interleaved runs, each in a fresh
process with its imports done before the clock starts: the token ids `encode_batch` produces
for the documents prepare keeps, divided by each contender's wall time (so each ratio is a
ratio of times on the same work). "Per repeat" is the ratio within each repeat.

{chr(10).join(sections)}
## What is compared

- **prepare_data** (ours): `kubellm.data.prepare.prepare` on the raw JSONL (read,
  normalize, filter, dedup, split, tokenize, pack, write zstd Parquet shards, manifest),
  seq_len {SEQ_LEN}, default filters; `bench/prepare_bench.py` `run_prepare` is the one
  call. Tokenizer: {measured[0].tp.last_ours["tokenizer_mode"]}.
- **the floor**: `tokenizers.Tokenizer.from_file(<tokenizer dir>/tokenizer.json)` over the
  kept texts already in memory (the corpus generator's companion file, normalized), in
  batches of {args.floor_batch} documents, `add_special_tokens=False`; tokens = number of
  ids. Both batch calls are timed: `encode_batch` and `encode_batch_fast` (no character
  offsets). A separate untimed run compares their ids document by document; the floor is
  the faster call of those that give `encode_batch`'s ids.
- **datasets.map** (peer): `datasets.load_dataset("json", data_files=<kept JSONL>)` into a
  fresh cache dir, `.map(batched=True)` (batch 1000, num_proc=None: the fast tokenizer
  already uses every core) calling `PreTrainedTokenizerFast.from_pretrained(<tokenizer dir>)`,
  then numpy concatenate-with-EOS-and-chunk packing to seq_len {SEQ_LEN} and zstd Parquet,
  timed from the JSONL file. Its input is the companion file of the kept documents only (its
  JSON reader stops at the first malformed line), so it does no cleaning, dedup or split:
  less work than prepare_data does.
- **the `kubellm prepare` process** (issue 21): `kubellm prepare OUT --set data_source=<raw
  JSONL> --set tokenizer=<dir> --set text_field=text --set seq_len={SEQ_LEN} --set
  vocab_size={VOCAB}`, the same prepare as ours, timed by this harness from the process's
  start to its exit (CPU from `getrusage(RUSAGE_CHILDREN)`): what a user waits for, imports
  and tokenizer load included. The **start-up probe** is the same command on the corpus's
  first {STARTUP_RECORDS}+ kept records ({STARTUP_CHARS // 1024} KiB or more): its wall time
  is the process's fixed cost.
- Peak memory is the VmHWM of a fresh `python -m bench.prepare_bench --child memory`
  process running prepare alone, read from /proc/self/status (`getrusage(RUSAGE_CHILDREN)`
  is not used: on Linux it also counts the parent's memory that the child had before
  `exec`).
- The tokenizers: a byte-level BPE of vocab {VOCAB} per corpus
  (`kubellm.data.tokenizer.train_bpe`), trained once on the corpus's first
  {TOKENIZER_SAMPLE_MIB:g} MiB of kept text and cached.
- The corpora: `bench/corpus.py`, seed {args.seed}, generated and cached under the cache
  directory.

## Machine

| | |
|---|---|
{machine}
"""
    return "\n\n".join(tables), md


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--corpus",
        choices=(*KINDS, "both", "all"),
        default="all",
        help="which corpus (both: clean and messy; all: every kind)",
    )
    ap.add_argument("--size-mb", type=float, help="1× corpus, MiB (default 20; quick 1)")
    ap.add_argument(
        "--short-size-mb",
        type=float,
        help=f"the short-record corpus, MiB (default {SHORT_SIZE_FACTOR:g} × --size-mb: "
        "100k+ records at full size)",
    )
    ap.add_argument("--scale", type=float, help="memory: scale× vs 1× (default 10; quick 3)")
    ap.add_argument("--repeats", type=int, help="runs each, best used (default 3; quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/benchmarks-prepare.md", help="markdown report")
    ap.add_argument("--json", default="", help="also write the figures as JSON here")
    ap.add_argument("--cache-dir", default="runs/bench", help="corpora, tokenizer, scratch")
    ap.add_argument("--floor-batch", type=int, default=4096, help="documents per tokenizer call")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (smoke test)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    kinds = ("memory", "ours", "floor", "peer", "floor_fast", "ids")
    ap.add_argument("--child", choices=kinds, help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, full, quick in (("size_mb", 20.0, 1.0), ("scale", 10.0, 3.0), ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.short_size_mb is None:
        args.short_size_mb = SHORT_SIZE_FACTOR * args.size_mb
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    command = shlex.join(["python", "-m", "bench.prepare_bench", *sys.argv[1:]])
    if argv is not None:
        command = shlex.join(["python", "-m", "bench.prepare_bench", *argv])
    cache = Path(args.cache_dir).resolve()
    work = cache / "work"
    work.mkdir(parents=True, exist_ok=True)
    info = machine_info()  # before the runs: the source they ran (git HEAD)

    t0 = time.perf_counter()
    kinds = {"all": KINDS, "both": ("clean", "messy")}.get(args.corpus, (args.corpus,))
    measured: list[Measured] = []
    for kind in kinds:
        if kind in MEMORY_CORPORA:
            big_mb = args.size_mb * args.scale
            print(f"{kind} corpus: {args.size_mb:g} MiB and {big_mb:g} MiB in {cache}")
            small = ensure_corpus(cache, args.size_mb, args.seed, kind)
            big: Corpus | None = ensure_corpus(cache, big_mb, args.seed, kind)
        else:
            print(f"{kind} corpus: {args.short_size_mb:g} MiB in {cache}")
            small, big = ensure_corpus(cache, args.short_size_mb, args.seed, kind), None
        tokenizer_dir = ensure_tokenizer(cache, small, args.seed)
        print(f"  tokenizer: {tokenizer_dir}")
        print(
            f"  throughput: {args.repeats} interleaved repeat(s) on {small.path.name}", flush=True
        )
        tp = measure_throughput(small, tokenizer_dir, work, args.repeats, args.floor_batch, kind)
        mem1 = mem_n = None
        if big is not None:
            print("  peak memory: fresh prepare processes at 1× and scale×", flush=True)
            mem1 = run_child("memory", small.path, tokenizer_dir, work, args.floor_batch)
            mem_n = run_child("memory", big.path, tokenizer_dir, work, args.floor_batch)
        measured.append(Measured(small, big, tp, mem1, mem_n))

    tables, md = report(args, measured, info, command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    if args.json:
        figures = {
            m.small.kind: {
                "ratios": m.ratios(),
                "floor": m.tp.floor.name,
                "same_ids": m.tp.ids["same_ids"],
                "seconds": {r.name: r.seconds for r in m.tp.all_runs},
                "cpu_seconds": {r.name: r.cpu_seconds for r in m.tp.all_runs},
                "prepare_seconds_in_process": m.tp.last_cli.get("prepare_seconds"),
                "reference_tokens": m.tp.batch.tokens,
                "memory": {"1x": m.mem1, "scale": m.mem_n},
                "tokenizer_mode": m.tp.last_ours["tokenizer_mode"],
            }
            for m in measured
        }
        figures["commit"] = info.get("git HEAD", "")  # type: ignore[assignment]
        Path(args.json).write_text(json.dumps(figures, indent=2))
    print()
    print(tables)
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    ok = all(
        m.floor_ok
        and (m.small.kind not in ISSUE3_TARGET_CORPORA or r["peer"] >= TARGET_PEER)
        and (m.small.kind not in ISSUE3_TARGET_CORPORA or r["memory"] <= TARGET_MEMORY)
        for m, r in ((m, m.ratios()) for m in measured)
    )
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
