"""SlurmTrainer against the real test Slurm: a tiny training job completes with its metrics;
`scancel --signal=USR1` mid-run checkpoints, requeues and resumes to the same weights as an
uninterrupted run; a bad config fails with Slurm's state, the exit code and the log tail; a
stopped step leaves nothing in squeue."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from slurmkit import SlurmCluster, free_port_block, tiny_config, write_config

from kubellm.backends.base import JobFailed, JobTimeout, TrainJob
from kubellm.backends.slurm.script import SlurmSettings
from kubellm.backends.slurm.trainer import SlurmJobStopped, SlurmTrainer, job_info, squeue_ids

pytestmark = pytest.mark.slow
ARRAY_TASKS = 8  # the most trials a test's array job has, and some


def _trainer(tmp: Path, **values) -> SlurmTrainer:
    tmp.chmod(0o755)
    base = {"work_dir": str(tmp / "slurm"), "cpus_per_task": 2, "memory": "4Gi"}
    # an array's task i rendezvous on rdzv_port + i: a block of free ports for the tuner's
    port = free_port_block(ARRAY_TASKS)
    return SlurmTrainer(SlurmSettings(**{**base, "rdzv_port": port, **values}), echo=False)


def _job(tmp: Path, name: str, config: Path, **values) -> TrainJob:
    env = {"OMP_NUM_THREADS": "1"}
    return TrainJob(
        name=name, train_args=["--config", str(config)], nproc_per_node=2, env=env, **values
    )


def _wait_for(path_of, pattern: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = path_of()
        if path and path.exists() and re.search(pattern, path.read_text(), re.M):
            return
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not seen in {path_of()}")


def drained(timeout_s: float = 60) -> None:
    """squeue is empty (a cancelled job leaves it within a few seconds)."""
    deadline = time.monotonic() + timeout_s
    while squeue_ids() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert squeue_ids() == []


def test_a_tiny_training_job_completes_with_its_metrics(
    slurm: SlurmCluster, tiny_dataset: Path, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path / "c.json", tiny_config(tiny_dataset, tmp_path / "model"))
    result = _trainer(tmp_path).run(_job(tmp_path, "tiny", cfg))
    assert "slurm: job " in result.logs and "slurm: step exited with 0" in result.logs
    assert result.metrics["step"] == 8 and "eval_loss" in result.metrics, result.logs[-2000:]
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert squeue_ids() == []


def test_usr1_checkpoints_requeues_resumes_and_ends_equal_to_an_uninterrupted_run(
    slurm: SlurmCluster, tiny_dataset: Path, tmp_path: Path
) -> None:
    values = {"steps": 500, "log_every": 50, "checkpoint_every": 10_000}
    ref_cfg = write_config(
        tmp_path / "ref.json", tiny_config(tiny_dataset, tmp_path / "ref", **values)
    )
    ckpt = tmp_path / "ckpt"
    cfg = tiny_config(tiny_dataset, tmp_path / "pre", checkpoint_dir=str(ckpt), **values)
    pre_cfg = write_config(tmp_path / "pre.json", cfg)
    # The uninterrupted run beside the interrupted one (the node has room for both): its
    # requeue wait and start-ups overlap the other's work.
    ref = SlurmTrainer(_trainer(tmp_path).settings, echo=False)
    trainer = _trainer(tmp_path)
    logs: dict[str, str] = {}
    errors: list[BaseException] = []

    def run(name: str, t: SlurmTrainer, cfg: Path) -> None:
        try:
            logs[name] = t.run(_job(tmp_path, name, cfg)).logs
        except BaseException as err:
            errors.append(err)

    threads = [
        threading.Thread(target=run, args=("ref", ref, ref_cfg)),
        threading.Thread(target=run, args=("pre", trainer, pre_cfg)),
    ]
    for thread in threads:
        thread.start()
    out = lambda: next(iter((tmp_path / "slurm").glob("pre-*.out")), None)  # noqa: E731
    _wait_for(out, r"^step=100 ")
    assert trainer.job_id
    subprocess.run(["scancel", "--signal=USR1", trainer.job_id], check=True)
    for thread in threads:
        thread.join(timeout=240)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    text = logs["pre"]
    stopped = re.search(r"pre-empted by SIGUSR1 after step (\d+) \(checkpoint written\)", text)
    assert stopped, text[-3000:]
    step = int(stopped.group(1))
    assert "requeueing job" in text and "(restart 1)" in text, text[-3000:]
    assert f"resumed from {ckpt}/step-{step:08d} at step {step}" in text, text[-3000:]
    assert step < values["steps"]
    info = job_info(trainer.job_id)
    assert info and info["JobState"] == "COMPLETED" and info["Restarts"] == "1"
    a = load_file(tmp_path / "ref" / "model.safetensors")
    b = load_file(tmp_path / "pre" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bad_config_fails_with_slurms_state_exit_code_and_log_tail(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"steps": -1}))
    with pytest.raises(JobFailed) as err:
        _trainer(tmp_path).run(_job(tmp_path, "bad", bad))
    message = str(err.value)
    assert "JobState=FAILED" in message and "Reason=NonZeroExitCode" in message, message
    assert "ExitCode=2:0" in message and err.value.exit_code == 2, message
    assert "steps" in message and "slurm: step exited with 2" in message, message


def test_a_stopped_step_cancels_its_job(
    slurm: SlurmCluster, tiny_dataset: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "m", steps=100_000, log_every=50)
    path = write_config(tmp_path / "c.json", cfg)
    trainer = _trainer(tmp_path)

    def stop() -> None:
        _wait_for(lambda: next(iter((tmp_path / "slurm").glob("long-*.out")), None), r"^step=50 ")
        os.kill(os.getpid(), signal.SIGTERM)  # what Argo / kfp.local send the step

    threading.Thread(target=stop, daemon=True).start()
    with pytest.raises(SlurmJobStopped) as err:
        trainer.run(_job(tmp_path, "long", path))
    assert err.value.code == 143 and "cancelled" in str(err.value)
    drained()
    assert job_info(trainer.job_id or "")["JobState"] == "CANCELLED"


def test_a_job_past_its_timeout_is_cancelled(
    slurm: SlurmCluster, tiny_dataset: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "m", steps=100_000, log_every=50)
    path = write_config(tmp_path / "c.json", cfg)
    trainer = _trainer(tmp_path)
    with pytest.raises(JobTimeout, match=r"still RUNNING after 10s; job \d+ cancelled"):
        trainer.run(_job(tmp_path, "slow", path, timeout_s=10.0))
    drained()


def test_the_exit_handler_cancels_the_runs_jobs_and_no_others(
    slurm: SlurmCluster, tiny_dataset: Path, tmp_path: Path
) -> None:
    """A step killed without its SIGTERM leaves its job running: the exit handler
    (Backends.release_run -> SlurmTrainer.release) cancels the run's jobs, by their comment."""
    cfg = tiny_config(tiny_dataset, tmp_path / "m", steps=100_000, log_every=50)
    path = write_config(tmp_path / "c.json", cfg)
    mine = _trainer(tmp_path, run_id="run-a")
    (tmp_path / "o").mkdir()
    other = _trainer(tmp_path / "o", run_id="run-b")
    (a, _), (b, _) = mine.submit(_job(tmp_path, "a", path)), other.submit(_job(tmp_path, "b", path))
    try:
        said = mine.release("run-a")
        assert said == [f"slurm job {a} (a): job {a} cancelled"]
        deadline = time.monotonic() + 60
        while a in squeue_ids() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert a not in squeue_ids() and b in squeue_ids()
        assert mine.release("run-a") == []  # nothing left of that run
    finally:
        subprocess.run(["scancel", b], check=False)
