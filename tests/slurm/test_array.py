"""A search as one Slurm array job, without Slurm: the script's task index picks its trial
(run with stand-ins for srun and scontrol), and the trials sampled up front are the ones the
local tuner samples one by one for the same seed. tests/slurm/test_tuner.py runs the array
on the real test Slurm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kubellm.backends.base import TrainJob, TuneRequest
from kubellm.backends.local.optuna_tuner import OptunaTuner
from kubellm.backends.slurm.script import SlurmSettings
from kubellm.backends.slurm.tuner import STARTUP_TRIALS, plan
from kubellm.tune.search import SearchParam

SPACE = [
    SearchParam("learning_rate", 1e-3, 4e-3, log=True),
    SearchParam("warmup_steps", 10, 100, kind="int"),
]


def _request(**values) -> TuneRequest:
    base = {
        "name": "kubellm-tiny-tune-abc",
        "trial_job": TrainJob(name="kubellm-tiny-tune-abc", train_args=["--config", "/s/t.json"]),
        "space": SPACE,
        "max_trials": 3,
        "parallel_trials": 2,
        "seed": 7,
    }
    return TuneRequest(**{**base, **values})


def _run_task(tmp_path: Path, script: str, index: str) -> tuple[int, str]:
    """The batch script as task `index` runs it, srun and scontrol echoing their arguments."""
    path = tmp_path / "a.sbatch"
    path.write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, body in {"srun": 'echo "srun $*"', "scontrol": "echo node-0"}.items():
        (bin_dir / tool).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_ARRAY_TASK_ID": index,
        "SLURM_JOB_ID": "41",
        "SLURM_JOB_NODELIST": "node-0",
    }
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env)
    return out.returncode, out.stdout


def test_the_array_script_runs_the_trial_its_index_picks(tmp_path: Path) -> None:
    arr = plan(_request(), SlurmSettings(work_dir="/s/slurm", python="python"))
    assert "#SBATCH --array=0-2%2" in arr.script
    assert "#SBATCH --output=/s/slurm/kubellm-tiny-tune-abc-%A_%a.out" in arr.script
    assert len(arr.trials) == 3
    for i, (job, params) in enumerate(arr.trials):
        assert job.name == f"kubellm-tiny-tune-abc-trial-{i}"
        code, out = _run_task(tmp_path, arr.script, str(i))
        assert code == 0, out
        (srun,) = [ln for ln in out.splitlines() if ln.startswith("srun ")]
        lr = repr(params["learning_rate"])
        assert f"--set learning_rate={lr}" in srun, srun
        others = [repr(p["learning_rate"]) for j, (_, p) in enumerate(arr.trials) if j != i]
        assert not any(o in srun for o in others), srun
        # tasks of one array may share a node: each rendezvous on its own port
        assert f"master node-0:{29500 + i}" in out, out
    code, out = _run_task(tmp_path, arr.script, "3")
    assert code != 0 and "slurm: no trial 3 in this array" in out, out


def test_parallel_is_capped_by_the_trials() -> None:
    script = plan(_request(max_trials=2, parallel_trials=8), SlurmSettings()).script
    assert "#SBATCH --array=0-1%2" in script


@pytest.mark.parametrize("algorithm", ["random", "tpe", "bayesianoptimization", "grid"])
def test_trials_sampled_up_front_are_the_local_tuners(algorithm: str) -> None:
    """Up to optuna's start-up trials, sampling all before any result changes nothing: the
    array's trials are the ones OptunaTuner runs one by one (platform=slurm and local agree)."""
    from tests.tune.test_local_tuner import QuadraticJob

    request = _request(max_trials=4, algorithm=algorithm)
    local = QuadraticJob()
    OptunaTuner(local).tune(request)
    arr = plan(request, SlurmSettings())
    assert [p for _, p in arr.trials] == local.seen
    assert len({tuple(p.values()) for _, p in arr.trials}) == 4  # no trial twice
    assert request.max_trials <= STARTUP_TRIALS
