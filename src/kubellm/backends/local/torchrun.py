"""The local trainer: runs in the pipeline step's process and starts torchrun (the agent,
`kubellm.train.agent`) as a child, which starts the workers (`python -m kubellm.train`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kubellm.backends.base import JobFailed, JobResult, JobTimeout, Trainer, TrainJob
from kubellm.config import CPU_NPROC
from kubellm.train.metric_lines import parse_metrics

# Device nodes of an NVIDIA driver (Linux, and WSL2's GPU paravirtualization): without one
# no CUDA device can be visible, and torch (seconds of CPU to import) is not asked.
_DRIVER_NODES = ("/dev/nvidiactl", "/dev/dxg")


def visible_gpus() -> int:
    """The CUDA devices a training process on this machine sees (CUDA_VISIBLE_DEVICES
    applied): torch's count, 0 when it cannot use them (a CPU-only build, a driver too old
    for its CUDA) or when there is no NVIDIA driver at all."""
    if not any(os.path.exists(node) for node in _DRIVER_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_nproc() -> int:
    """Processes of a local training job when none are asked for: one per GPU, else
    CPU_NPROC (gloo on the CPU)."""
    return visible_gpus() or CPU_NPROC


class TorchrunTrainer(Trainer):
    """Runs torchrun (`python -m kubellm.train.agent --standalone --nproc_per_node=N
    --max-restarts=R -m <module> ARGS`) as a child process.

    Output streams through line by line (progress), and is kept for the metrics. A job past
    its timeout is killed with its whole process group.
    """

    def __init__(self, echo: bool = True, log_path: str | Path | None = None) -> None:
        self.echo = echo
        # With a log file, the whole output goes there and only progress and metric lines
        # (rank 0's `train: ...` and `name=value` lines) are echoed.
        self.log_path = Path(log_path) if log_path else None

    def run(self, job: TrainJob) -> JobResult:
        if job.nnodes != 1:
            raise JobFailed(
                f"num_nodes={job.nnodes}: the local trainer runs one node; "
                "multi-node training needs platform=kubernetes (a PyTorchJob)"
            )
        cmd = [
            sys.executable,
            "-m",
            "kubellm.train.agent",
            "--standalone",
            f"--nproc_per_node={job.nproc_per_node}",
            f"--max-restarts={job.max_restarts}",
            "-m",
            job.module,
            *job.train_args,
        ]
        env = {**os.environ, **job.env, "PYTHONUNBUFFERED": "1"}
        print(f"[{job.name}] {' '.join(cmd[2:])}", flush=True)
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        lines: list[str] = []

        log = open(self.log_path, "w") if self.log_path else None  # noqa: SIM115

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if log is not None:
                    log.write(line)
                if self.echo and _echoed(line, brief=log is not None):
                    print(f"[{job.name}] {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = time.monotonic() + job.timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                _kill_group(proc)
                raise JobTimeout(f"{job.name}: still running after {job.timeout_s:.0f}s; killed")
            time.sleep(0.1)
        reader.join(timeout=5)
        if log is not None:
            log.close()
        logs = "".join(lines)
        if proc.returncode != 0:
            reason = _reason(lines)
            where = f" (full log: {self.log_path})" if self.log_path else ""
            raise JobFailed(
                f"{job.name}: exit code {proc.returncode}: {reason}{where}", proc.returncode
            )
        return JobResult(name=job.name, logs=logs, metrics=parse_metrics(logs))


def _echoed(line: str, brief: bool) -> bool:
    if "OMP_NUM_THREADS" in line or "*****" in line:
        return False
    return not brief or line.startswith("train: ") or "=" in line.split(" ", 1)[0]


def _reason(lines: list[str]) -> str:
    """The most telling line of a failed job: our own `error:` line, else the exception."""
    stripped = [ln.strip() for ln in lines if ln.strip()]
    for prefix in ("error:", "Error:"):
        ours = [ln for ln in stripped if ln.startswith(prefix)]
        if ours:
            return ours[-1]
    exc = [ln for ln in stripped if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
    if exc:
        return exc[-1]
    return stripped[-1] if stripped else "no output"


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
