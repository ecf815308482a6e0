"""Faults under the real launcher: a worker SIGKILLed, SIGTERM pre-emption, Slurm's SIGUSR1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainkit import tiny_config, write_config

from kubellm.train.agent import exit_code
from kubellm.train.checkpoint import complete_checkpoints
from kubellm.train.preempt import EXIT_PREEMPTED

pytestmark = pytest.mark.slow
TIMEOUT_S = 240


class Launch:
    """`python -m kubellm.train.agent ...` as a child process whose output is watched."""

    def __init__(
        self, config: Path, *torchrun_args: str, env: dict[str, str] | None = None
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "kubellm.train.agent",
            "--standalone",
            "--nproc_per_node=2",
            *torchrun_args,
            "-m",
            "kubellm.train",
            "--config",
            str(config),
        ]
        env = {**(env or os.environ), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def logs(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str) -> re.Match[str]:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.logs[-3000:]}")

    def workers(self) -> list[int]:
        """PIDs of the worker processes (the launcher's children), by local rank order."""
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False
        )
        return sorted(int(p) for p in out.stdout.split())

    def finish(self) -> int:
        try:
            code = self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launcher still running; output:\n{self.logs[-3000:]}") from None
        self._reader.join(timeout=5)
        return code


def _endless(dataset: Path, tmp: Path, ckpt: Path) -> Path:
    """A run that only a signal ends (100,000 steps), checkpointing into `ckpt`."""
    cfg = tiny_config(dataset, tmp / "m", steps=100_000, log_every=20, checkpoint_dir=str(ckpt))
    return write_config(tmp / "c.json", cfg)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_sigkilled_worker_is_restarted_and_ends_equal_to_an_uninterrupted_run(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    # The kill follows the step-100 checkpoint's log line at once: 500 steps are left, 2.5 s
    # at ~5 ms a step on a quiet machine (a loaded one is slower, so leaves more)
    values = {"steps": 600, "log_every": 100, "checkpoint_every": 50}
    ref_cfg = tiny_config(tiny_dataset, tmp_path / "ref", **values)
    ref = Launch(write_config(tmp_path / "ref.json", ref_cfg))
    assert ref.finish() == 0, ref.logs[-3000:]

    ckpt = tmp_path / "ckpt"
    cfg = tiny_config(tiny_dataset, tmp_path / "killed", checkpoint_dir=str(ckpt), **values)
    run = Launch(write_config(tmp_path / "killed.json", cfg), "--max-restarts=1")
    run.wait_for(r"train: checkpoint .*step-00000100 committed")
    victim = run.workers()[-1]
    os.kill(victim, signal.SIGKILL)
    assert run.finish() == 0, run.logs[-3000:]
    logs = run.logs
    assert re.search(rf"local_rank: \d \(pid: {victim}\)", logs) or "exitcode: -9" in logs
    resumed = re.search(r"train: resumed from .*step-(\d+) at step (\d+)", logs)
    assert resumed, logs[-3000:]
    from_ckpt, at_step = int(resumed.group(1)), int(resumed.group(2))
    # The kill landed mid-training: the restart resumed below the final step and trained the
    # rest. A kill during export (after the last step) would resume at 1,500 with nothing left.
    assert from_ckpt == at_step
    assert 100 <= at_step < values["steps"], logs[-3000:]
    assert re.search(rf"^step={values['steps']} ", logs[resumed.end() :], re.M), logs[-3000:]
    a, b = _weights(tmp_path / "ref"), _weights(tmp_path / "killed")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_checkpoints_exits_with_the_documented_code_and_a_restart_continues(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    config = _endless(tiny_dataset, tmp_path, ckpt)
    run = Launch(config)
    run.wait_for(r"^step=40 ")
    run.proc.send_signal(signal.SIGTERM)  # what the kubelet sends the pod's main process
    assert run.finish() == EXIT_PREEMPTED, run.logs[-3000:]
    stopped = re.search(r"pre-empted by SIGTERM after step (\d+) \(checkpoint written\)", run.logs)
    assert stopped, run.logs[-3000:]
    step = int(stopped.group(1))
    assert [p.name for p in complete_checkpoints(ckpt)] == [f"step-{step:08d}"]

    again = Launch(config)  # the retried pod: same command, same config
    again.wait_for(rf"train: resumed from .*step-{step:08d} at step {step}")
    again.wait_for(rf"^step={(step // 20 + 1) * 20} ")
    again.proc.send_signal(signal.SIGTERM)
    assert again.finish() == EXIT_PREEMPTED


def test_sigusr1_to_one_worker_stops_every_rank_at_the_same_step(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    run = Launch(_endless(tiny_dataset, tmp_path, ckpt))
    run.wait_for(r"^step=40 ")
    os.kill(run.workers()[-1], signal.SIGUSR1)  # rank 1 only: the ranks must agree
    assert run.finish() == EXIT_PREEMPTED, run.logs[-3000:]
    stopped = re.search(r"pre-empted by (SIGUSR1|a peer rank) after step (\d+)", run.logs)
    assert stopped, run.logs[-3000:]
    assert complete_checkpoints(ckpt)[0].name == f"step-{int(stopped.group(2)):08d}"


def test_launcher_exit_codes() -> None:
    assert exit_code([EXIT_PREEMPTED, -15], -15) == EXIT_PREEMPTED
    assert exit_code([2, -15], 2) == 2
    assert exit_code([1, 2], 1) == 1
    assert exit_code([-9], -9) == 1
    assert exit_code([3, -15], 3) == 3  # the fabric check: no RDMA
    assert exit_code([4], 4) == 4  # the fabric check: bus bandwidth too low


def test_a_truncated_shard_fails_the_job_with_one_line_and_exit_2(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    """The shard is checked against the manifest's SHA-256 before the process group starts:
    no pyarrow traceback, no crash (exit 1), but the not-retried exit 2 naming the shard."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    shard = sorted((data / "train").glob("*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    cfg = tiny_config(data, tmp_path / "m")
    env = {**os.environ, "KUBELLM_SHARD_CACHE": str(tmp_path / "cache")}
    proc = Launch(write_config(tmp_path / "c.json", cfg), env=env)
    assert proc.finish() == 2, proc.logs[-3000:]
    errors = [line for line in proc.logs.splitlines() if line.startswith("error: ")]
    # each rank checks its shard and exits 2 with the line; the first to exit ends the job,
    # and torchrun stops the other, which may not have printed yet (kubellm.process.exit_now
    # ends a rank at once), so one or two lines
    assert 1 <= len(errors) <= 2, proc.logs[-3000:]
    assert all(f"train/{shard.name}: sha256" in e and "manifest" in e for e in errors), errors
    assert "Traceback" not in proc.logs, proc.logs[-3000:]


def test_a_tracking_server_outage_mid_training_stalls_nothing_and_loses_nothing(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    """A real `mlflow server` is stopped at step 200 and started again (same port, same
    database) OUTAGE_S later: training goes on meanwhile, completes with exit 0, and every
    loss point reaches MLflow (the sink buffered them: 0 dropped)."""
    from mlflow.tracking import MlflowClient

    from kubellm.backends.local.model_server import free_port
    from tracking.mlflow_server import running_mlflow_server

    outage_s = 6.0
    db = tmp_path / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()  # the schema
    port = free_port()
    with running_mlflow_server(tmp_path, db, port=port) as server:
        client = MlflowClient(tracking_uri=server.url)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        steps = 1500
        cfg = tiny_config(
            tiny_dataset,
            tmp_path / "m",
            steps=steps,
            log_every=10,
            save_model=False,
            mlflow_tracking_uri=server.url,
            mlflow_run_id=run_id,
        )
        run = Launch(write_config(tmp_path / "c.json", cfg))
        run.wait_for(r"^step=200 ")
    down_at = len(step_lines := [ln for ln in run.lines if ln.startswith("step=")])
    time.sleep(outage_s)  # the server is down; training goes on
    during = len([ln for ln in run.lines if ln.startswith("step=")]) - down_at
    with running_mlflow_server(tmp_path, db, port=port):
        assert run.finish() == 0, run.logs[-3000:]
        assert during > 0, "no step finished while the tracking server was down"
        sent = re.search(r"train: mlflow: (\d+) metric points sent, (\d+) dropped", run.logs)
        assert sent and sent.group(2) == "0", run.logs[-3000:]
        history = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}").get_metric_history(
            run_id, "loss"
        )
    assert sorted(m.step for m in history) == list(range(10, steps + 1, 10)), step_lines[:3]
