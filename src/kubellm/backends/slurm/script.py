"""The sbatch script of a TrainJob: the same request a PyTorchJob is built from, for Slurm.

One task per node runs the per-node agent (`python -m kubellm.train.agent`, torchrun),
which starts `nproc_per_node` workers; the nodes rendezvous over c10d at the first node of
the allocation. Slurm fills in what the Training Operator fills in on Kubernetes:

| PyTorchJob | sbatch |
|---|---|
| Master + Workers (num_nodes pods) | `--nodes=N --ntasks-per-node=1` |
| nvidia.com/gpu limit | `--gres=gpu:N` |
| cpu, memory requests | `--cpus-per-task`, `--mem` |
| activeDeadlineSeconds | `--time`: timeout + grace, minutes rounded up (USR1 at the timeout) |
| terminationGracePeriodSeconds (SIGTERM, then KILL) | `--signal=USR1@grace` (to the steps) |
| restartPolicy ExitCode (200 retried) | exit 200 -> `scontrol requeue`, at most max_requeues |
| PET_MASTER_ADDR | the first host of `scontrol show hostnames $SLURM_JOB_NODELIST` |
| PET_NODE_RANK | `$SLURM_NODEID`, expanded in each task (not in the batch shell) |
| Katib trials, parallelTrialCount | one `--array=0-N%parallel` job; the index picks the trial |

Example (what `kubellm render --target slurm` prints):

    build_sbatch(TrainJob(name="llm-train", train_args=["--config", "/shared/train.json"],
        nnodes=2, nproc_per_node=8), SlurmSettings(gpus_per_node=8, partition="gpu"))
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kubellm.backends.base import TrainJob
from kubellm.backends.nccl import fabric_env
from kubellm.config import PipelineConfig, quantity

# The agent's exit code for "checkpointed on a signal; run me again" (kubellm.train.preempt;
# not imported from there: that package imports torch).
EXIT_PREEMPTED = 200
# Where the nodes rendezvous (c10d's TCPStore on the first node).
RDZV_PORT = 29500
# The last line the script prints: how its step ended (read when the controller has
# forgotten the job).
END_MARKER = "slurm: step exited with "
# The largest sig_time sbatch takes (--signal, seconds).
MAX_SIGNAL_TIME = 65535


@dataclass(frozen=True)
class SlurmSettings:
    """What a run adds to its jobs on Slurm: resources, where they run, the fabric's NCCL
    settings, and where scripts and their output files go (a filesystem the compute nodes
    share with the login node)."""

    work_dir: str = "."
    gpus_per_node: int = 0
    cpus_per_task: int = 0  # 0: Slurm's default (one)
    memory: str = ""  # a Kubernetes quantity (`24Gi`); empty: Slurm's default
    grace_seconds: int = 300
    partition: str = ""
    account: str = ""
    max_requeues: int = 3
    nccl_env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable  # the interpreter of kubellm on the compute nodes
    rdzv_port: int = RDZV_PORT
    run_id: str = ""  # the pipeline run's: each job's comment, which the exit handler finds

    @classmethod
    def from_config(cls, cfg: PipelineConfig, kfp_run_id: str = "") -> SlurmSettings:
        work = Path(cfg.runs_dir) / "slurm" / (kfp_run_id or "jobs")
        return cls(
            run_id=kfp_run_id,
            work_dir=str(work),
            gpus_per_node=cfg.gpus_per_node,
            cpus_per_task=math.ceil(quantity(cfg.job_cpu)) if cfg.job_cpu else 0,
            memory=cfg.job_memory,
            grace_seconds=cfg.job_grace_seconds,
            partition=cfg.slurm_partition,
            account=cfg.slurm_account,
            max_requeues=cfg.job_max_restarts,
            nccl_env=fabric_env(cfg.fabric, cfg.nccl_env),
        )


def memory_mb(text: str) -> int:
    """A Kubernetes quantity as Slurm's --mem megabytes (MiB), rounded up."""
    return math.ceil(quantity(text) / 2**20)


def signal_seconds(settings: SlurmSettings) -> int:
    """How long before its time limit Slurm signals the steps (`--signal=USR1@N`)."""
    return max(0, min(settings.grace_seconds, MAX_SIGNAL_TIME))


def time_minutes(timeout_s: float, settings: SlurmSettings) -> int:
    """The job's `--time`: its timeout plus the signal's lead, rounded up to minutes, so that
    USR1 never comes before the timeout (a 1-minute limit with a 300 s lead would signal the
    steps as they start, and they would checkpoint and requeue at once)."""
    return max(1, math.ceil((timeout_s + signal_seconds(settings)) / 60))


def output_path(settings: SlurmSettings, job: TrainJob, array: bool = False) -> str:
    """The job's output file (%j: the job id; an array's task: %A_%a, the array's id and the
    task's index); appended to across requeues."""
    return str(Path(settings.work_dir) / f"{job.name}-{'%A_%a' if array else '%j'}.out")


def agent_command(job: TrainJob, settings: SlurmSettings) -> str:
    """What each task runs: the agent with the node's rank and the c10d rendezvous, as one
    shell line whose `$SLURM_*` are expanded by the task's own shell."""
    quoted = " ".join(
        shlex.quote(a)
        for a in [
            settings.python,
            "-m",
            "kubellm.train.agent",
            f"--nproc_per_node={job.nproc_per_node}",
            f"--max-restarts={job.max_restarts}",
        ]
    )
    per_node = (
        "--nnodes=$SLURM_JOB_NUM_NODES --node_rank=$SLURM_NODEID --rdzv_backend=c10d "
        "--rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv_id=$SLURM_JOB_ID"
    )
    train = " ".join(shlex.quote(a) for a in ["-m", job.module, *job.train_args])
    return f"exec {quoted} {per_node} {train}"


def _srun_lines(job: TrainJob, s: SlurmSettings, trials: Sequence[TrainJob]) -> list[str]:
    """The step: one srun of the agent, or, in an array, a `case` on the task index."""
    if not trials:
        return [f"srun --ntasks-per-node=1 bash -c {shlex.quote(agent_command(job, s))}"]
    lines = ['case "$SLURM_ARRAY_TASK_ID" in']
    for i, trial in enumerate(trials):
        lines += [
            f"  {i})  # {trial.name}",
            f"    srun --ntasks-per-node=1 bash -c {shlex.quote(agent_command(trial, s))} ;;",
        ]
    lines += ['  *) echo "slurm: no trial $SLURM_ARRAY_TASK_ID in this array"; false ;;', "esac"]
    return lines


def run_comment(run_id: str) -> str:
    """The comment (`sbatch --comment`, squeue's %k) of every job of pipeline run `run_id`."""
    return f"kubellm.dev/run={run_id}"


def build_sbatch(
    job: TrainJob,
    settings: SlurmSettings | None = None,
    trials: Sequence[TrainJob] = (),
    parallel: int = 1,
) -> str:
    """The sbatch script for `job` (see the module docstring for the mapping).

    With `trials` it is one array job (`--array=0-N%parallel`, at most `parallel` tasks at a
    time) of `job`'s resources whose task index picks the trial: task i runs `trials[i]`'s
    module and arguments, rendezvous on port rdzv_port + i (tasks may share a node)."""
    s = settings or SlurmSettings()
    if job.nnodes < 1 or job.nproc_per_node < 1:
        raise ValueError(
            f"TrainJob {job.name!r}: nnodes and nproc_per_node must be >= 1, "
            f"got {job.nnodes} and {job.nproc_per_node}"
        )
    if trials and parallel < 1:
        raise ValueError(f"array job {job.name!r}: parallel must be >= 1, got {parallel}")
    opts = [
        f"--job-name={job.name}",
        f"--nodes={job.nnodes}",
        "--ntasks-per-node=1",
    ]
    if trials:
        opts.append(f"--array=0-{len(trials) - 1}%{parallel}")
    if s.run_id:
        opts.append(f"--comment={run_comment(s.run_id)}")
    if s.gpus_per_node:
        opts.append(f"--gres=gpu:{s.gpus_per_node}")
    if s.cpus_per_task:
        opts.append(f"--cpus-per-task={s.cpus_per_task}")
    if s.memory:
        opts.append(f"--mem={memory_mb(s.memory)}M")
    opts += [
        f"--time={time_minutes(job.timeout_s, s)}",
        # no B: prefix: the signal goes to the steps (the agents), not to the batch shell
        f"--signal=USR1@{signal_seconds(s)}",
        "--requeue",
        "--open-mode=append",
        f"--output={output_path(s, job, array=bool(trials))}",
    ]
    if s.partition:
        opts.append(f"--partition={s.partition}")
    if s.account:
        opts.append(f"--account={s.account}")
    env = {**s.nccl_env, **job.env, "PYTHONUNBUFFERED": "1"}
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts), ""]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines += [
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        (
            f"export MASTER_PORT=$(({s.rdzv_port} + SLURM_ARRAY_TASK_ID))"
            if trials
            else f"export MASTER_PORT={s.rdzv_port}"
        ),
        "restarts=${SLURM_RESTART_COUNT:-0}",
        'echo "slurm: job $SLURM_JOB_ID (restart $restarts) on $SLURM_JOB_NODELIST, '
        'master $MASTER_ADDR:$MASTER_PORT"',
        # A signal meant for the steps that reaches this shell too must not end it: the
        # steps checkpoint and their exit code decides (a trapped signal is reset in srun).
        "trap 'echo \"slurm: batch shell got SIGUSR1\"' USR1",
        *_srun_lines(job, s, trials),
        "rc=$?",
        # --requeue alone requeues on node failure and pre-emption by Slurm, not on an
        # exit code: a checkpointed stop asks for it itself.
        f'if [ "$rc" -eq {EXIT_PREEMPTED} ] && [ "$restarts" -lt {s.max_requeues} ]; then',
        '  echo "slurm: pre-empted (exit $rc): requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  sleep 30  # the requeue ends this script",
        "fi",
        f'echo "{END_MARKER}$rc"',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"
