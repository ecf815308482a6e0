"""`make test`: the whole suite as two pytest processes side by side, one lane each.

    python tests/lanes.py [PYTEST ARGS...]     # ARGS go to both lanes (e.g. -p no:cacheprovider)

Most of the suite's time is interpreters starting (torch and transformers cost ~7 s of one
core in every training rank, pipeline step and model server) and one-core work in between,
so one pytest process leaves a core idle about a third of the time (DEVELOPERS.md). Lane A
is training under torchrun and the end-to-end runs plus some small directories; lane B is
everything else. A lane is whole directories, so each session fixture is built by the one
process that uses it. Each lane's output goes to a log file; every minute a line says how
far each lane is, and when both are done their outputs are printed, lane A first. The exit
code is the first non-zero one (0 when both pass).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Lane A; lane B is tests/ without these. Keep the two about even when a directory grows.
LANE_A = (
    "tests/train",
    "tests/e2e",
    "tests/tune",
    "tests/data",
    "tests/pipelines",
    "tests/render",
    "tests/manifests",
    "tests/containers",
    "tests/test_cli.py",
    "tests/test_config.py",
    "tests/test_layers.py",
    "tests/test_local_run.py",
    # three fresh venvs, installing side by side (minutes; DEVELOPERS.md)
    "tests/test_install.py",
    # a real Slurm (munged, slurmctld, slurmd) and the pipeline on it (about 6 minutes)
    "tests/slurm",
)
PROGRESS = re.compile(r"\[\s*(\d+)%\]")
HEARTBEAT_S = 60.0


def lanes(args: list[str]) -> dict[str, list[str]]:
    pytest = [sys.executable, "-m", "pytest", *args]
    return {
        "A": [*pytest, *LANE_A],
        "B": [*pytest, "tests", *(f"--ignore={path}" for path in LANE_A)],
    }


def _progress(log: Path) -> str:
    found = PROGRESS.findall(log.read_text(errors="replace")) if log.exists() else []
    return f"{found[-1]}%" if found else "collecting"


def _state(proc: subprocess.Popen[bytes], log: Path) -> str:
    return _progress(log) if proc.poll() is None else f"done (exit {proc.returncode})"


def main(args: list[str]) -> int:
    logs_dir = Path(tempfile.mkdtemp(prefix="kubellm-test-lanes-"))
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    started = time.monotonic()
    for name, cmd in lanes(args).items():
        log = logs_dir / f"lane-{name}.log"
        print(f"lane {name}: {' '.join(cmd[1:])} > {log}", flush=True)
        with log.open("wb") as out:
            procs[name] = (
                subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT),
                log,
            )
    next_beat = started + HEARTBEAT_S
    try:
        while any(p.poll() is None for p, _ in procs.values()):
            time.sleep(2.0)
            if time.monotonic() >= next_beat:
                next_beat += HEARTBEAT_S
                state = ", ".join(f"lane {n} {_state(p, log)}" for n, (p, log) in procs.items())
                print(f"[{time.monotonic() - started:5.0f}s] {state}", flush=True)
    except KeyboardInterrupt:
        for proc, _ in procs.values():
            proc.terminate()
        raise
    codes = {}
    for name, (proc, log) in procs.items():
        codes[name] = proc.wait()
        print(f"\n{'=' * 30} lane {name} (exit {codes[name]}) {'=' * 30}", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
    elapsed = time.monotonic() - started
    print(f"\nlanes: {codes} in {elapsed:.0f}s; logs in {logs_dir}", flush=True)
    return next((c for c in codes.values() if c), 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
