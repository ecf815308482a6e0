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
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path

import pytest  # for the TempPathFactory type
from background_runs import BackgroundRuns

REPO = Path(__file__).resolve().parents[2]
PARALLEL = 2


@dataclass(frozen=True)
class BenchRun:
    """One quick run: its folder (out files and cache), its process's output."""

    tmp: Path
    proc: subprocess.CompletedProcess[str]


# module (under bench/), its arguments (file names go under the run's folder), a timeout
# (generous: alone, each takes 1-3 minutes; with the other lane running, up to ~7), whether it
# runs alone
HARNESSES: dict[str, tuple[str, list[str], float, bool]] = {
    "gpu_check": ("gpu_check", ["--dry-run", "--out", "gpu-check/summary.md"], 900, False),
    "prepare": ("prepare_bench", ["--quick", "--out", "bench.md"], 900, False),
    "startup": ("startup_bench", ["--quick", "--out", "startup.md"], 900, False),
    "train": ("train_bench", ["--quick", "--out", "train.md", "--json", "train.json"], 900, False),
    "serve": ("serve_bench", ["--quick", "--out", "serve.md", "--json", "serve.json"], 900, True),
}


class BenchRuns(BackgroundRuns):
    ORDER = tuple(HARNESSES)  # serve last

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        super().__init__(PARALLEL, "bench")
        self._tmp = tmp

    def run(self, name: str) -> BenchRun:
        module, args, timeout_s, alone = HARNESSES[name]
        if alone:  # started after the others (FIFO): it waits for at most the one still running
            wait([f for n, f in self.futures.items() if n != name])
        tmp = self._tmp.mktemp(f"bench-{name}")
        paths = [str(tmp / a) if a.endswith((".md", ".json")) else a for a in args]
        cmd = [sys.executable, "-m", f"bench.{module}", *paths, "--cache-dir", str(tmp / "cache")]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        return BenchRun(tmp, proc)
