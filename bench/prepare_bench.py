"""Benchmark of prepare_data (issue 3): throughput against two references, and peak memory.

On one generated corpus, in one run, interleaved, best of `--repeats`:

1. prepare_data end to end (JSONL -> clean -> dedup -> tokenize -> pack -> Parquet) against
   the fast tokenizer's own `encode_batch` over the kept texts, already in memory (the floor);
   target: ours >= 0.85 x floor.
2. prepare_data against a `datasets` peer: `load_dataset("json")`, `.map(batched=True)` with
   the same tokenizer as a PreTrainedTokenizerFast, the same concatenate-with-EOS-and-chunk
   packing (numpy), Parquet out, timed from the JSONL file; target: ours >= 1.3 x peer.
3. Peak memory (VmHWM) of a fresh process running prepare on `--scale` x the input against
   1 x; target: <= 1.25.

All three use one byte-level BPE (vocab 8192) trained once on a sample of the corpus and
cached, so tokenizer training is not what is measured. Throughput is reported as reference
tokens per second: the number of token ids encode_batch produces for the kept documents,
divided by each contender's wall time, so the ratios are ratios of times on identical work.

    python -m bench.prepare_bench [--size-mb 20] [--scale 10] [--repeats 3] [--out PATH]
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

from bench.corpus import MIB, Corpus, ensure_corpus, kept_texts
from bench.machine import machine_info as base_machine_info

REPO = Path(__file__).resolve().parents[1]
VOCAB = 8192
SEQ_LEN = 1024
SHARD_ROWS = 65_536
TOKENIZER_SAMPLE_MIB = 4.0
CHILD_TAG = "BENCH_CHILD "
TARGET_FLOOR = 0.85  # ours / encode_batch, at least
TARGET_PEER = 1.3  # ours / datasets.map + packing, at least
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


def run_floor(tokenizer_dir: Path, texts: list[str], batch: int, fast: bool = False) -> int:
    """encode_batch over texts already in memory; returns the number of token ids.

    fast: encode_batch_fast (the same ids without offsets), reported for information only.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    n = 0
    for i in range(0, len(texts), batch):
        n += sum(len(e) for e in encode(texts[i : i + batch], add_special_tokens=False))
    return n


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
    ours, floor, peer: one timed run after the imports (and, for the floor, the texts).
    """
    tok_dir, out_dir = Path(args.tokenizer_dir), Path(args.out_dir)
    result: dict[str, Any] = {}
    if args.child == "memory":
        import kubellm.data.prepare  # noqa: F401  (imports count in the baseline, not the run)

        result["baseline_kib"] = _proc_status_kib("VmRSS")
    else:
        warm_imports(tok_dir)
    if args.child in ("memory", "ours"):
        t0 = time.perf_counter()
        manifest, mode = _quiet(lambda: run_prepare(Path(args.source), out_dir, tok_dir))
        seconds = time.perf_counter() - t0
        tokens = manifest["tokens"]["train"] + manifest["tokens"]["val"]
        result.update(kept=manifest["records"]["kept"], tokenizer_mode=mode)
    elif args.child in ("floor", "floor_fast"):
        texts = kept_texts(Path(args.source))
        t0 = time.perf_counter()
        tokens = run_floor(tok_dir, texts, args.floor_batch, fast=args.child == "floor_fast")
        seconds = time.perf_counter() - t0
    elif args.child == "peer":
        t0 = time.perf_counter()
        tokens = _quiet(lambda: run_peer(Path(args.source), tok_dir, out_dir))
        seconds = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown child {args.child!r}")
    result.update(seconds=seconds, tokens=tokens, vmhwm_kib=_proc_status_kib("VmHWM"))
    print(CHILD_TAG + json.dumps(result), flush=True)
    return 0


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
    tokens: int = 0  # the contender's own count (ours: the manifest's; peer: ids + EOS)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def measure_throughput(
    corpus: Corpus, tokenizer_dir: Path, work: Path, repeats: int, floor_batch: int
) -> dict[str, Any]:
    floor, ours, peer = Runs("encode_batch"), Runs("prepare_data"), Runs("datasets.map")
    fast = Runs("encode_batch_fast")  # for information: the ids without the offsets
    runs = {"floor": floor, "ours": ours, "peer": peer, "floor_fast": fast}
    last: dict[str, Any] = {}
    kinds = list(runs)
    for r in range(repeats):  # interleaved; the order rotates so no one always goes first
        for kind in kinds[r % 4 :] + kinds[: r % 4]:
            source = corpus.path if kind == "ours" else corpus.kept_path
            result = run_child(kind, source, tokenizer_dir, work, floor_batch)
            runs[kind].seconds.append(result["seconds"])
            runs[kind].tokens = result["tokens"]
            if kind == "ours":
                last = result
        print(
            f"  repeat {r + 1}/{repeats}: encode_batch {floor.seconds[-1]:.2f}s, "
            f"prepare_data {ours.seconds[-1]:.2f}s, datasets.map {peer.seconds[-1]:.2f}s, "
            f"encode_batch_fast {fast.seconds[-1]:.2f}s",
            flush=True,
        )
    return {
        "floor": floor,
        "ours": ours,
        "peer": peer,
        "floor_fast": fast,
        "last_ours": last,
        "mode": last["tokenizer_mode"],
    }


def machine_info() -> dict[str, str]:
    return base_machine_info(
        ("torch", "tokenizers", "transformers", "pyarrow", "datasets", "numpy")
    )


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "nan"


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def report(
    args: argparse.Namespace,
    small: Corpus,
    big: Corpus,
    tp: dict[str, Any],
    mem1: dict[str, Any],
    mem_n: dict[str, Any],
    info: dict[str, str],
    command: str,
) -> tuple[str, str, dict[str, float]]:
    """(the results table, the whole markdown report, the three ratios)."""
    floor, ours, peer = tp["floor"], tp["ours"], tp["peer"]
    ref = floor.tokens  # reference tokens: ids encode_batch gives the kept documents

    def rate(runs: Runs) -> float:
        return ref / runs.best

    r_floor = floor.best / ours.best
    r_peer = peer.best / ours.best
    peak1, peak_n = mem1["vmhwm_kib"] / 1024, mem_n["vmhwm_kib"] / 1024
    r_mem = peak_n / peak1
    s = args.scale
    table = "\n".join(
        [
            "| metric | ours | peer | ratio | target | result |",
            "|---|---:|---:|---:|---|---|",
            f"| throughput vs `encode_batch` floor (tokens/s) | {_fmt(rate(ours))} "
            f"| {_fmt(rate(floor))} | {r_floor:.2f} | ≥ {TARGET_FLOOR} "
            f"| {_verdict(r_floor >= TARGET_FLOOR)} |",
            f"| throughput vs `datasets.map` + packing (tokens/s) | {_fmt(rate(ours))} "
            f"| {_fmt(rate(peer))} | {r_peer:.2f} | ≥ {TARGET_PEER} "
            f"| {_verdict(r_peer >= TARGET_PEER)} |",
            f"| peak RSS, {s:g}× input (ours) vs 1× input (peer), MiB | {_fmt(peak_n)} "
            f"| {_fmt(peak1)} | {r_mem:.2f} | ≤ {TARGET_MEMORY} "
            f"| {_verdict(r_mem <= TARGET_MEMORY)} |",
        ]
    )
    runs_rows = []
    for runs in (ours, floor, peer, tp["floor_fast"]):
        cells = " | ".join(f"{x:.2f}" for x in runs.seconds)
        runs_rows.append(
            f"| {runs.name} | {cells} | {runs.best:.2f} | {runs.median:.2f} "
            f"| {_fmt(rate(runs))} | {runs.tokens:,} |"
        )
    n = len(ours.seconds)
    paired = []
    for ref_runs in (floor, peer):
        rs = [b / a for a, b in zip(ours.seconds, ref_runs.seconds, strict=True)]
        paired.append(
            f"vs {ref_runs.name} {', '.join(f'{r:.2f}' for r in rs)} "
            f"(median {statistics.median(rs):.2f})"
        )
    header = " | ".join(f"run {i + 1}" for i in range(n))
    mem_rows = []
    for label, c, mm in (("1×", small, mem1), (f"{s:g}×", big, mem_n)):
        mem_rows.append(
            f"| {label} | {c.size_bytes / MIB:,.1f} | {c.records:,} | {mm['kept']:,} "
            f"| {mm['vmhwm_kib'] / 1024:,.0f} | {mm['baseline_kib'] / 1024:,.0f} "
            f"| {mm['seconds']:.1f} "
            f"| {_fmt(mm['tokens'] / mm['seconds'])} |"
        )
    kept_note = ""
    if tp["last_ours"]["kept"] != small.kept:
        kept_note = (
            f"\n**Note:** prepare kept {tp['last_ours']['kept']:,} records, the corpus generator "
            f"expects {small.kept:,}; the floor and the peer tokenize the generator's set.\n"
        )
    g1 = (mem1["vmhwm_kib"] - mem1["baseline_kib"]) / 1024
    gn = (mem_n["vmhwm_kib"] - mem_n["baseline_kib"]) / 1024
    machine = "\n".join(f"| {k} | {v} |" for k, v in info.items())
    md = f"""# prepare_data benchmark

Issue 3's three targets, measured on one generated corpus in one run on this machine
({info["nproc"]} CPUs, {info["date"]}). Rerun with `make bench`, or:

```
{command}
```

## Results

{table}

Throughput is reference tokens per second, best of {n} interleaved runs, each in a fresh
process with its imports done before the clock starts: the
{ref:,} token ids `encode_batch` produces for the {small.kept:,} documents prepare keeps from
the {small.size_bytes / MIB:.1f} MiB corpus, divided by each contender's wall time (so
each ratio is a ratio of times on the same work).
Peak memory is the VmHWM of a fresh `python -m bench.prepare_bench --child memory` process
running prepare alone, read from /proc/self/status (`getrusage(RUSAGE_CHILDREN)` is not
used: on Linux it also counts the parent's memory that the child had before `exec`).
Tokenizer in prepare_data: {tp["mode"]}.
{kept_note}
## Runs (seconds, wall)

| contender | {header} | best | median | tokens/s (best) | own token count |
|---|{"---:|" * n}---:|---:|---:|---:|
{chr(10).join(runs_rows)}

Ratios within each repeat (runs seconds apart; a check on the machine's noise):
{"; ".join(paired)}.

## Peak memory (prepare_data in a fresh process)

| input | MiB | records | kept | peak RSS (VmHWM), MiB | RSS after imports, MiB \
| seconds | tokens/s |
|---|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(mem_rows)}

Growth above the RSS after imports: {g1:,.0f} MiB at 1×, {gn:,.0f} MiB at {s:g}× \
(ratio {gn / max(g1, 1e-9):.2f}; informational, the target is on the whole peak).

## What is compared

- **prepare_data** (ours): `kubellm.data.prepare.prepare` on the raw JSONL
  ({small.records:,} records: {small.duplicates:,} exact duplicates and {small.bad:,} bad
  lines among them), seq_len {SEQ_LEN}, writing zstd Parquet shards; `bench/prepare_bench.py`
  `run_prepare` is the one call.
- **encode_batch** (floor): `tokenizers.Tokenizer.from_file(<tokenizer dir>/tokenizer.json)`
  `.encode_batch(texts, add_special_tokens=False)` over the kept texts already in memory, in
  batches of {args.floor_batch} documents; tokens = number of ids. `encode_batch_fast` (the
  same ids without character offsets) is timed the same way for information only: a stage
  that uses it can beat the `encode_batch` floor.
- **datasets.map** (peer): `datasets.load_dataset("json", data_files=<kept JSONL>)` into a
  fresh cache dir, `.map(batched=True)` (batch 1000, num_proc=None: the fast tokenizer
  already uses every core) calling `PreTrainedTokenizerFast.from_pretrained(<tokenizer dir>)`,
  then numpy concatenate-with-EOS-and-chunk packing to seq_len {SEQ_LEN} and zstd Parquet,
  timed from the JSONL file. Its input is the companion file of the kept documents only (its
  JSON reader stops at the first malformed line), so it does no cleaning, dedup or split:
  less work than prepare_data does.
- The tokenizer: a byte-level BPE of vocab {VOCAB} (`kubellm.data.tokenizer.train_bpe`),
  trained once on the corpus's first {TOKENIZER_SAMPLE_MIB:g} MiB and cached.
- The corpus: `bench/corpus.py`, seed {args.seed}: English-like documents of 300 to about
  3000 characters from a Zipf-weighted vocabulary; the {s:g}× corpus
  ({big.size_bytes / MIB:,.1f} MiB) is generated from the same seed, not repeated.

## Machine

| | |
|---|---|
{machine}
"""
    return table, md, {"floor": r_floor, "peer": r_peer, "memory": r_mem}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, help="1× corpus, MiB (default 20; quick 1)")
    ap.add_argument("--scale", type=float, help="memory: scale× vs 1× (default 10; quick 3)")
    ap.add_argument("--repeats", type=int, help="runs each, best used (default 3; quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/benchmarks-prepare.md", help="markdown report")
    ap.add_argument("--json", default="", help="also write the figures as JSON here")
    ap.add_argument("--cache-dir", default="runs/bench", help="corpora, tokenizer, scratch")
    ap.add_argument("--floor-batch", type=int, default=4096, help="documents per encode_batch")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (smoke test)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    kinds = ("memory", "ours", "floor", "peer", "floor_fast")
    ap.add_argument("--child", choices=kinds, help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, full, quick in (("size_mb", 20.0, 1.0), ("scale", 10.0, 3.0), ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
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

    t0 = time.perf_counter()
    print(f"corpora: {args.size_mb:g} MiB and {args.size_mb * args.scale:g} MiB in {cache}")
    small = ensure_corpus(cache, args.size_mb, args.seed)
    big = ensure_corpus(cache, args.size_mb * args.scale, args.seed)
    tokenizer_dir = ensure_tokenizer(cache, small, args.seed)
    print(f"tokenizer: {tokenizer_dir}")
    print(f"throughput: {args.repeats} interleaved repeat(s) on {small.path.name}", flush=True)
    tp = measure_throughput(small, tokenizer_dir, work, args.repeats, args.floor_batch)
    print("peak memory: fresh prepare processes at 1× and scale×", flush=True)
    mem1 = run_child("memory", small.path, tokenizer_dir, work, args.floor_batch)
    mem_n = run_child("memory", big.path, tokenizer_dir, work, args.floor_batch)

    table, md, ratios = report(args, small, big, tp, mem1, mem_n, machine_info(), command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    if args.json:
        figures = {
            "ratios": ratios,
            "seconds": {k: tp[k].seconds for k in ("ours", "floor", "peer", "floor_fast")},
            "reference_tokens": tp["floor"].tokens,
            "memory": {"1x": mem1, "scale": mem_n},
            "tokenizer_mode": tp["mode"],
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))
    print()
    print(table)
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    ok = (
        ratios["floor"] >= TARGET_FLOOR
        and ratios["peer"] >= TARGET_PEER
        and ratios["memory"] <= TARGET_MEMORY
    )
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
