"""SlurmTuner against the real test Slurm: a search is one array job whose tasks are its
trials, at most tune_parallel at a time; failures past max_failed_trials cancel the rest; a
stopped step and the exit handler leave nothing in squeue."""

from __future__ import annotations

import os
import re
import signal
import threading
from datetime import datetime
from pathlib import Path

import pytest
from slurmkit import SlurmCluster, tiny_config, write_config
from test_trainer import _trainer, _wait_for, drained

from kubellm.backends.base import JobFailed, TrainJob, TuneRequest
from kubellm.backends.slurm.trainer import (
    SlurmJobStopped,
    SlurmTrainer,
    job_records,
    sbatch,
    squeue_ids,
)
from kubellm.backends.slurm.tuner import SlurmTuner, plan
from kubellm.tune.search import SearchParam

pytestmark = pytest.mark.slow
LR = SearchParam("learning_rate", 1e-3, 4e-3, log=True)


def _request(config: Path, space=(LR,), **values) -> TuneRequest:
    job = TrainJob(
        name="tune",
        train_args=["--config", str(config)],
        nproc_per_node=2,
        env={"OMP_NUM_THREADS": "1"},
    )
    base = {"name": "tune", "trial_job": job, "space": list(space), "max_trials": 3, "seed": 3}
    return TuneRequest(**{**base, **values})


def _trial_config(dataset: Path, tmp_path: Path, **values):
    """A trial's config as stages.tune makes it: parallel trials share one output_dir, so
    none exports (two exports into one directory race)."""
    return tiny_config(dataset, tmp_path / "trials", save_model=False, **values)


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value)


def test_a_search_is_one_array_job_whose_tasks_are_its_trials(
    slurm: SlurmCluster, tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path / "t.json", _trial_config(tiny_dataset, tmp_path))
    request = _request(config, parallel_trials=2)
    tuner = SlurmTuner(_trainer(tmp_path).settings, echo=False)
    result = tuner.tune(request)
    out = capsys.readouterr().out
    assert [t.state for t in result.trials] == ["succeeded"] * 3, out
    values = [t.value for t in result.trials]
    assert len(set(values)) == 3  # three learning rates, three losses
    assert result.best_value == min(v for v in values if v is not None)
    # the trials are the ones the seed samples, in task order
    expected = [p for _, p in plan(request, tuner.settings).trials]
    assert [t.params for t in result.trials] == expected
    # one array job: each task a trial, its own output file with its own loss
    records = job_records(tuner.array_id or "")
    assert {r["ArrayJobId"] for r in records} == {tuner.array_id}
    tasks = {int(r["ArrayTaskId"]): r for r in records}
    assert sorted(tasks) == [0, 1, 2] and {r["JobState"] for r in records} == {"COMPLETED"}
    for i, trial in enumerate(result.trials):
        text = (tmp_path / "slurm" / f"tune-{tuner.array_id}_{i}.out").read_text()
        losses = [float(v) for v in re.findall(r"eval_loss=([\d.]+)", text)]
        assert losses and abs(losses[-1] - (trial.value or 0)) < 1e-3, text[-1500:]
    # at most two at a time: the third starts once one of the first two has ended
    first_end = min(_time(tasks[i]["EndTime"]) for i in (0, 1))
    assert _time(tasks[2]["StartTime"]) >= first_end, tasks
    assert squeue_ids() == []


def test_failures_past_max_failed_trials_cancel_the_rest_of_the_array(
    slurm: SlurmCluster, tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path / "t.json", _trial_config(tiny_dataset, tmp_path))
    bad = SearchParam("steps", -9, -1, kind="int")  # every trial's config is invalid
    request = _request(config, space=(bad,), parallel_trials=1, max_failed_trials=0)
    tuner = SlurmTuner(_trainer(tmp_path).settings, echo=False)
    with pytest.raises(JobFailed, match="all 3 trials failed"):
        tuner.tune(request)
    out = capsys.readouterr().out
    assert re.search(r"trial 0 failed: tune-trial-0: slurm job \d+_0 failed: JobState=FAILED", out)
    assert re.search(r"1 trials failed \(more than max_failed_trials=0\): job \d+ cancelled", out)
    # the last task never started
    assert not (tmp_path / "slurm" / f"tune-{tuner.array_id}_2.out").exists()
    drained()


def test_a_stopped_step_and_the_exit_handler_cancel_the_array(
    slurm: SlurmCluster, tiny_dataset: Path, tmp_path: Path
) -> None:
    cfg = _trial_config(tiny_dataset, tmp_path, steps=100_000, log_every=50)
    config = write_config(tmp_path / "t.json", cfg)
    request = _request(config, max_trials=2, parallel_trials=1)
    tuner = SlurmTuner(_trainer(tmp_path, run_id="run-s").settings, echo=False)

    def stop() -> None:
        _wait_for(lambda: next((tmp_path / "slurm").glob("tune-*_0.out"), None), r"^step=50 ")
        os.kill(os.getpid(), signal.SIGTERM)  # what Argo / kfp.local send the step

    threading.Thread(target=stop, daemon=True).start()
    with pytest.raises(SlurmJobStopped, match=r"stopped \(SIGTERM\); job \d+ cancelled"):
        tuner.tune(request)
    drained()
    # a step killed without its SIGTERM: the exit handler finds the array by the run's
    # comment and cancels it once (one running task, one pending)
    (tmp_path / "h").mkdir()
    settings = _trainer(tmp_path / "h", run_id="run-h").settings
    Path(settings.work_dir).mkdir(parents=True)
    array_id = sbatch(Path(settings.work_dir) / "h.sbatch", plan(request, settings).script)
    _wait_for(lambda: next((tmp_path / "h" / "slurm").glob("tune-*_0.out"), None), r"^step=50 ")
    said = SlurmTrainer(settings).release("run-h")
    assert said == [f"slurm job {array_id} (tune): job {array_id} cancelled"]
    drained()
