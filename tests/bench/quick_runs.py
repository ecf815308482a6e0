"""The quick benchmark runs the bench tests check, started together (the `bench_runs`
fixture in conftest.py).

Each harness is a subprocess (`python -m bench.<name> --quick`) that the suite used to run
one after the other; most of their time is one core's work (interpreters starting, one
contender at a time), so two at once share the machine's two cores better. The serving
benchmark runs alone, after the others: its latency figures and its locust run are the
ones that load would disturb. A test asks for its run and waits for it; a test selected
alone starts only its own run.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import pytest  # for the TempPathFactory type

REPO = Path(__file__).resolve().parents[2]
PARALLEL = 2


@dataclass(frozen=True)
class BenchRun:
    """One quick run: its folder (out files and cache), its process's output."""

    tmp: Path
    proc: subprocess.CompletedProcess[str]


# module (under bench/), its extra arguments given the run's folder, timeout, whether it runs alone
HARNESSES: dict[str, tuple[str, list[str], float, bool]] = {
    "gpu_check": ("gpu_check", ["--device", "cpu", "--quick", "--out", "gpu-check.md"], 400, False),
    "prepare": ("prepare_bench", ["--quick", "--out", "bench.md"], 400, False),
    "startup": ("startup_bench", ["--quick", "--out", "startup.md"], 600, False),
    "train": ("train_bench", ["--quick", "--out", "train.md", "--json", "train.json"], 300, False),
    "serve": ("serve_bench", ["--quick", "--out", "serve.md", "--json", "serve.json"], 300, True),
}


class BenchRuns:
    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self._tmp = tmp
        self._pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="bench")
        self._lock = threading.Lock()
        self._runs: dict[str, Future[BenchRun]] = {}

    def start(self, name: str) -> None:
        with self._lock:
            if name not in self._runs:
                others = [f for n, f in self._runs.items() if n != name]
                self._runs[name] = self._pool.submit(self._run, name, others)

    def result(self, name: str) -> BenchRun:
        self.start(name)
        return self._runs[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, name: str, others: list[Future[BenchRun]]) -> BenchRun:
        module, args, timeout_s, alone = HARNESSES[name]
        if alone:
            wait(others)  # started after them (FIFO): it waits for at most the one still running
        tmp = self._tmp.mktemp(f"bench-{name}")
        paths = [str(tmp / a) if a.endswith((".md", ".json")) else a for a in args]
        cmd = [sys.executable, "-m", f"bench.{module}", *paths, "--cache-dir", str(tmp / "cache")]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        return BenchRun(tmp, proc)
