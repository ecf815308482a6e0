"""The Slurm trainer: a training job is an sbatch script (kubellm.backends.slurm.script) sent
from the login node, where the pipeline's step runs; the step waits for it and streams its
output file.

- The job's state is `scontrol show job`'s (no slurmdbd needed): JobState, Reason,
  ExitCode, Restarts. A job the controller has forgotten (past MinJobAge) is read from its
  output file's last line (`slurm: step exited with N`).
- A pre-empted job (the agent's exit 200) requeues itself and keeps its id; Slurm holds a
  requeued batch job until its old job credential expires (AuthInfo cred_expire + 1 s, 121 s
  by default: slurmd refuses the job before that), then it resumes from its checkpoint.
- A job that fails raises JobFailed with Slurm's JobState, Reason and ExitCode and the
  output's last lines; past its timeout, or when the step is stopped (SIGTERM), the job is
  `scancel`ed (the step then exits 143, as a stopped cluster step does).

Example (on a login node; runs_dir on a filesystem the compute nodes share):

    SlurmTrainer(SlurmSettings(work_dir="/shared/runs/slurm", partition="gpu")).run(
        TrainJob(name="llm-train", train_args=["--config", "/shared/train.json"], nnodes=2))
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from kubellm.backends.base import (
    JobFailed,
    JobResult,
    JobTimeout,
    Terminated,
    Trainer,
    TrainJob,
    sigterm_raises,
)
from kubellm.backends.slurm.script import (
    END_MARKER,
    SlurmSettings,
    build_sbatch,
    output_path,
    run_comment,
)
from kubellm.train.metric_lines import parse_metrics

# Job states after which nothing more happens (squeue(1) JOB STATE CODES).
TERMINAL = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
LOG_TAIL_LINES = 20
# After the job ends, how long its output file gets to show the script's last line.
LOG_DRAIN_S = 5.0
EXIT_STOPPED = 128 + signal.SIGTERM
POLL_S = 0.5


class SlurmJobStopped(SystemExit):
    """The step was stopped (SIGTERM) while its job ran; the job has been cancelled."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_STOPPED)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _slurm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise JobFailed(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def sbatch(path: Path, script: str) -> str:
    """Write `script` to `path` (its directory made if need be) and submit it; the job's id."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    out = _slurm("sbatch", "--parsable", str(path))
    job_id = out.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise JobFailed(f"{path.name}: sbatch answered {out.stdout.strip()!r}")
    return job_id


def job_records(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job -o`'s records of `job_id` (an array's: one per task, and one for
    its pending tasks, `ArrayTaskId=2-4%1`); none when the controller no longer knows it."""
    out = _slurm("scontrol", "show", "job", "-o", job_id, check=False)
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return []
        raise JobFailed(f"scontrol show job {job_id} failed: {out.stderr.strip()}")
    return [dict(re.findall(r"(\w+)=(\S*)", ln)) for ln in out.stdout.splitlines() if ln.strip()]


def job_info(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o`'s fields, or None when the controller no longer knows the job."""
    records = job_records(job_id)
    return records[0] if records else None


def cancel(job_id: str) -> str:
    """`scancel` the job, and say so; a job already gone is no error."""
    out = _slurm("scancel", job_id, check=False)
    return f"job {job_id} cancelled" if out.returncode == 0 else out.stderr.strip()


class Follow:
    """The output file, read as it grows (the job may not have created it yet)."""

    def __init__(self, path: Path, name: str, echo: bool) -> None:
        self.path, self.name, self.echo = path, name, echo
        self.text = ""
        self._pos = 0
        self._partial = ""

    def poll(self) -> None:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return
        if not chunk:
            return
        self.text += chunk
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        if self.echo:
            for line in lines:
                if "OMP_NUM_THREADS" not in line and "*****" not in line:
                    print(f"[{self.name}] {line}", flush=True)

    def tail(self, n: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.text.rstrip("\n").splitlines()[-n:])


@contextlib.contextmanager
def cancel_when_stopped(name: str, job_id: str) -> Iterator[None]:
    """Around the wait for `job_id` (inside sigterm_raises): SIGTERM or ^C `scancel`s the
    job; SIGTERM then ends the step with SlurmJobStopped (exit 143)."""
    try:
        yield
    except Terminated:
        message = f"{name}: the step was stopped (SIGTERM); {cancel(job_id)}"
        print(message, flush=True)
        raise SlurmJobStopped(message) from None
    except KeyboardInterrupt:
        cancel(job_id)
        raise


def drain(log: Follow, wait_s: float = LOG_DRAIN_S) -> None:
    """Read the output file to the script's last line: on a shared filesystem the job's
    end can be seen before the file's last writes (a cancelled job never writes it)."""
    deadline = time.monotonic() + wait_s
    log.poll()
    while END_MARKER not in log.text and time.monotonic() < deadline:
        time.sleep(0.2)
        log.poll()


class SlurmTrainer(Trainer):
    """Runs a TrainJob as an sbatch job and waits for it (see the module docstring)."""

    def __init__(self, settings: SlurmSettings | None = None, echo: bool = True) -> None:
        self.settings = settings or SlurmSettings()
        self.echo = echo
        self.job_id: str | None = None  # the job being waited for (tests signal it)

    def release(self, run_tag: str, namespace: str = "") -> list[str]:
        """The exit handler's cleanup: scancel every job of run `run_tag` still in squeue (a
        step killed without its SIGTERM leaves its job running); a line each."""
        if not run_tag:
            return []
        return [f"slurm job {i} ({name}): {cancel(i)}" for i, name in run_job_ids(run_tag)]

    def submit(self, job: TrainJob) -> tuple[str, Path]:
        """Write the script and sbatch it; returns the job id and its output file."""
        script = build_sbatch(job, self.settings)
        job_id = sbatch(Path(self.settings.work_dir) / f"{job.name}.sbatch", script)
        return job_id, Path(output_path(self.settings, job).replace("%j", job_id))

    def run(self, job: TrainJob) -> JobResult:
        with sigterm_raises():
            job_id, log_path = self.submit(job)
            self.job_id = job_id
            print(f"[{job.name}] slurm job {job_id}; output {log_path}", flush=True)
            log = Follow(log_path, job.name, self.echo)
            with cancel_when_stopped(job.name, job_id):
                info = self._wait(job, job_id, log)
        drain(log)
        return job_result(job, job_id, info, log)

    def _wait(self, job: TrainJob, job_id: str, log: Follow) -> dict[str, str] | None:
        deadline = time.monotonic() + job.timeout_s
        while True:
            log.poll()
            info = job_info(job_id)
            if info is None or info.get("JobState") in TERMINAL:
                return info
            if time.monotonic() > deadline:
                fate = cancel(job_id)
                raise JobTimeout(
                    f"{job.name}: slurm job {job_id} still {info.get('JobState')} after "
                    f"{job.timeout_s:.0f}s; {fate}\n{log.tail()}"
                )
            time.sleep(POLL_S)


def job_result(job: TrainJob, job_id: str, info: dict[str, str] | None, log: Follow) -> JobResult:
    """The ended job's result (its metric lines), or JobFailed with Slurm's JobState, Reason
    and ExitCode and the output's last lines. `info` None: the controller has forgotten the
    job, and the script's last line says how its step ended."""
    if info is None:  # forgotten by the controller: the script's last line says
        ended = [ln for ln in log.text.splitlines() if ln.startswith(END_MARKER)]
        code = int(ended[-1][len(END_MARKER) :]) if ended else None
        state, reason, exit_code = "unknown (no longer in slurmctld)", "", str(code)
    else:
        state, reason = info.get("JobState", "?"), info.get("Reason", "")
        exit_code = info.get("ExitCode", "")
        code = int(exit_code.split(":")[0]) if exit_code[:1].isdigit() else None
    if state == "COMPLETED" or (info is None and code == 0):
        return JobResult(name=job.name, logs=log.text, metrics=parse_metrics(log.text))
    why = f"JobState={state} Reason={reason} ExitCode={exit_code}"
    raise JobFailed(
        f"{job.name}: slurm job {job_id} failed: {why}; last lines of {log.path}:\n{log.tail()}",
        code,
    )


def run_job_ids(run_id: str) -> list[tuple[str, str]]:
    """(id, name) of the jobs in squeue that pipeline run `run_id` submitted (its comment);
    an array job once, by its array id (%F; a plain job's is its id)."""
    out = _slurm("squeue", "-h", "-o", "%F|%j|%k").stdout
    want = run_comment(run_id)
    rows = [line.split("|", 2) for line in out.splitlines() if line.count("|") >= 2]
    mine = [(i, name) for i, name, comment in rows if comment.strip() == want]
    return list(dict.fromkeys(mine))


def squeue_ids(name: str | None = None) -> list[str]:
    """Ids of the jobs in squeue (of job name `name`)."""
    args = ["squeue", "-h", "-o", "%i"]
    if name:
        args += ["-n", name]
    return _slurm(*args).stdout.split()
