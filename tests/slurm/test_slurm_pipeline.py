"""Issue 26's acceptance 1: `kubellm run --local --set platform=slurm` runs the whole pipeline
with tuning and training as Slurm jobs on the test Slurm, and its summary's data figures and
gate decision equal a `platform=local` run of the same seed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurmkit import SlurmCluster

pytestmark = pytest.mark.slow
# tests/e2e's SMALL: a tiny model, two short trials, a short training
SMALL = {
    "num_records": 3000,
    "vocab_size": 300,
    "seq_len": 16,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "tune_trials": 2,
    "tune_steps": 8,
    "train_steps": 40,
    "batch_size": 8,
}
# Rows of the summary that name the run or this machine's moment, not what was computed.
RUN_SPECIFIC = ("fabric all-reduce busbw", "best trial", "endpoint")


def _run(tmp: Path, platform: str) -> tuple[str, str]:
    """(what the terminal shows, the run's full log)."""
    runs = tmp / platform
    sets = [a for k, v in {**SMALL, "platform": platform, "runs_dir": runs}.items()
            for a in ("--set", f"{k}={v}")]  # fmt: skip
    cmd = [sys.executable, "-m", "kubellm.cli", "run", "--local", *sets]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (log,) = (runs / "logs").glob("run-*.log")
    return out.stdout, log.read_text()


def _summary(stdout: str) -> dict[str, str]:
    rows = re.findall(r"^\| ([^|]+?) \| (.*) \|$", stdout, re.M)
    return {k: v for k, v in rows if k.strip() and not k.startswith("-")}


def test_the_pipeline_on_slurm_equals_the_local_run(slurm: SlurmCluster, tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    on_slurm, slurm_log = _run(tmp_path, "slurm")
    jobs = re.findall(
        r"\[(kubellm-tiny-[a-z]+-\w+(?:-trial-\d+)?)\] slurm job (\d+(?:_\d+)?);", slurm_log
    )
    kinds = [re.sub(r"kubellm-tiny-([a-z]+)-.*?(-trial-\d+)?$", r"\1\2", n) for n, _ in jobs]
    # the log shows trials by name; preflight's fabric check, both trials and training
    assert kinds == ["fabric", "tune-trial-0", "tune-trial-1", "train"], jobs
    # the trials are tasks 0 and 1 of one array job
    (array,) = {i.split("_")[0] for _, i in jobs[1:3]}
    assert [i for _, i in jobs[1:3]] == [f"{array}_0", f"{array}_1"], jobs
    local, local_log = _run(tmp_path, "local")
    assert "slurm job" not in local_log
    a, b = _summary(on_slurm), _summary(local)
    assert "gate" in a and "data fingerprint" in a, on_slurm[-3000:]
    a, b = ({k: v for k, v in d.items() if not k.startswith(RUN_SPECIFIC)} for d in (a, b))
    assert len(a) >= 8 and a == b  # data figures, losses, evaluation, the gate
