"""The sbatch script of a TrainJob: the same request a PyTorchJob is built from, for Slurm.

One task per node runs the per-node agent (`python -m kubellm.train.agent`, torchrun),
which starts `nproc_per_node` workers; the nodes rendezvous over c10d at the first node of
the allocation. Slurm fills in what the Training Operator fills in on Kubernetes:

| PyTorchJob | sbatch |
|---|---|
| Master + Workers (num_nodes pods) | `--nodes=N --ntasks-per-node=1` |
| nvidia.com/gpu limit | `--gres=gpu:N` |
| cpu, memory requests | `--cpus-per-task`, `--mem` |
| activeDeadlineSeconds | `--time` (minutes, rounded up) |
| terminationGracePeriodSeconds (SIGTERM, then KILL) | `--signal=USR1@grace` (to the steps) |
| restartPolicy ExitCode (200 retried) | exit 200 -> `scontrol requeue`, at most max_requeues |
| PET_MASTER_ADDR | the first host of `scontrol show hostnames $SLURM_JOB_NODELIST` |
| PET_NODE_RANK | `$SLURM_NODEID`, expanded in each task (not in the batch shell) |

Example (what `kubellm render --target slurm` prints):

    build_sbatch(TrainJob(name="llm-train", train_args=["--config", "/shared/train.json"],
        nnodes=2, nproc_per_node=8), SlurmSettings(gpus_per_node=8, partition="gpu"))
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kubellm.backends.base import TrainJob
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
        from kubellm.backends.kubernetes.podspec import NCCL_PROFILES

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
            nccl_env={**NCCL_PROFILES.get(cfg.fabric, {}), **cfg.nccl_env},
        )


def memory_mb(text: str) -> int:
    """A Kubernetes quantity as Slurm's --mem megabytes (MiB), rounded up."""
    return math.ceil(quantity(text) / 2**20)


def time_minutes(timeout_s: float) -> int:
    return max(1, math.ceil(timeout_s / 60))


def output_path(settings: SlurmSettings, job: TrainJob) -> str:
    """The job's output file (%j: the job id); appended to across requeues."""
    return str(Path(settings.work_dir) / f"{job.name}-%j.out")


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


def run_comment(run_id: str) -> str:
    """The comment (`sbatch --comment`, squeue's %k) of every job of pipeline run `run_id`."""
    return f"kubellm.dev/run={run_id}"


def build_sbatch(job: TrainJob, settings: SlurmSettings | None = None) -> str:
    """The sbatch script for `job` (see the module docstring for the mapping)."""
    s = settings or SlurmSettings()
    if job.nnodes < 1 or job.nproc_per_node < 1:
        raise ValueError(
            f"TrainJob {job.name!r}: nnodes and nproc_per_node must be >= 1, "
            f"got {job.nnodes} and {job.nproc_per_node}"
        )
    opts = [
        f"--job-name={job.name}",
        f"--nodes={job.nnodes}",
        "--ntasks-per-node=1",
    ]
    if s.run_id:
        opts.append(f"--comment={run_comment(s.run_id)}")
    if s.gpus_per_node:
        opts.append(f"--gres=gpu:{s.gpus_per_node}")
    if s.cpus_per_task:
        opts.append(f"--cpus-per-task={s.cpus_per_task}")
    if s.memory:
        opts.append(f"--mem={memory_mb(s.memory)}M")
    opts += [
        f"--time={time_minutes(job.timeout_s)}",
        # no B: prefix: the signal goes to the steps (the agents), not to the batch shell
        f"--signal=USR1@{min(s.grace_seconds, MAX_SIGNAL_TIME)}",
        "--requeue",
        "--open-mode=append",
        f"--output={output_path(s, job)}",
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
        f"export MASTER_PORT={s.rdzv_port}",
        "restarts=${SLURM_RESTART_COUNT:-0}",
        'echo "slurm: job $SLURM_JOB_ID (restart $restarts) on $SLURM_JOB_NODELIST, '
        'master $MASTER_ADDR:$MASTER_PORT"',
        # A signal meant for the steps that reaches this shell too must not end it: the
        # steps checkpoint and their exit code decides (a trapped signal is reset in srun).
        "trap 'echo \"slurm: batch shell got SIGUSR1\"' USR1",
        f"srun --ntasks-per-node=1 bash -c {shlex.quote(agent_command(job, s))}",
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
