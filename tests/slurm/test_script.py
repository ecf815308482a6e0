"""The sbatch builder: every parameter of the training request maps to its sbatch option or
line (table-driven), and the script is valid bash."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kubellm.backends.base import TrainJob
from kubellm.backends.slurm.script import SlurmSettings, build_sbatch
from kubellm.config import PipelineConfig


def _job(**values) -> TrainJob:
    return TrainJob(name="llm-train", train_args=["--config", "/shared/c.json"], **values)


@dataclass
class Case:
    name: str
    job: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    present: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()


CASES = [
    Case(
        "defaults",
        present=(
            "#SBATCH --job-name=llm-train",
            "#SBATCH --nodes=1",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --time=65",  # 3600 s + the 300 s grace
            "#SBATCH --signal=USR1@300",
            "#SBATCH --requeue",
            "#SBATCH --open-mode=append",
            "#SBATCH --output=llm-train-%j.out",
            'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
            "export MASTER_PORT=29500",
            "export PYTHONUNBUFFERED=1",
            "--nnodes=$SLURM_JOB_NUM_NODES --node_rank=$SLURM_NODEID --rdzv_backend=c10d",
            "--rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv_id=$SLURM_JOB_ID",
            "--nproc_per_node=1 --max-restarts=0",
            "-m kubellm.train --config /shared/c.json",
            'if [ "$rc" -eq 200 ] && [ "$restarts" -lt 3 ]; then',
            'scontrol requeue "$SLURM_JOB_ID"',
        ),
        absent=("--gres", "--partition", "--account", "--cpus-per-task", "--mem", "NCCL_"),
    ),
    Case("num_nodes", job={"nnodes": 4}, present=("#SBATCH --nodes=4",)),
    Case("nproc_per_node", job={"nproc_per_node": 8}, present=("--nproc_per_node=8",)),
    Case("max_restarts (torchrun's)", job={"max_restarts": 2}, present=("--max-restarts=2",)),
    Case("module", job={"module": "kubellm.train.fabric"}, present=("-m kubellm.train.fabric",)),
    Case(
        "timeout plus grace rounds up",
        job={"timeout_s": 61.0},
        settings={"grace_seconds": 60},
        present=("#SBATCH --time=3",),
    ),
    Case("gpus_per_node", settings={"gpus_per_node": 8}, present=("#SBATCH --gres=gpu:8",)),
    Case("cpu", settings={"cpus_per_task": 16}, present=("#SBATCH --cpus-per-task=16",)),
    Case("memory", settings={"memory": "24Gi"}, present=("#SBATCH --mem=24576M",)),
    Case("grace", settings={"grace_seconds": 90}, present=("#SBATCH --signal=USR1@90",)),
    Case("grace capped", settings={"grace_seconds": 86400}, present=("--signal=USR1@65535",)),
    Case("partition", settings={"partition": "gpu"}, present=("#SBATCH --partition=gpu",)),
    Case("account", settings={"account": "team-a"}, present=("#SBATCH --account=team-a",)),
    Case("requeues", settings={"max_requeues": 0}, present=('[ "$restarts" -lt 0 ]',)),
    Case(
        "work_dir",
        settings={"work_dir": "/shared/r"},
        present=("--output=/shared/r/llm-train-%j.out",),
    ),
    Case("rdzv port", settings={"rdzv_port": 29123}, present=("export MASTER_PORT=29123",)),
    Case(
        "python",
        settings={"python": "/opt/venv/bin/python"},
        present=("exec /opt/venv/bin/python -m kubellm.train.agent",),
    ),
    Case(
        "nccl env and job env, quoted",
        job={"env": {"MLFLOW_TRACKING_URI": "sqlite:////a b/m.db"}},
        settings={"nccl_env": {"NCCL_IB_HCA": "mlx5"}},
        present=("export NCCL_IB_HCA=mlx5", "export MLFLOW_TRACKING_URI='sqlite:////a b/m.db'"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parameter_maps_to_sbatch(case: Case) -> None:
    script = build_sbatch(_job(**case.job), SlurmSettings(**{"python": "python", **case.settings}))
    for text in case.present:
        assert text in script, f"{text!r} not in\n{script}"
    for text in case.absent:
        assert text not in script, f"{text!r} in\n{script}"


@pytest.mark.parametrize("timeout_s", [1.0, 10.0, 59.0, 61.0, 299.0, 3600.0, 86400.0])
@pytest.mark.parametrize("grace", [0, 30, 300, 86400])
def test_the_signal_never_comes_before_the_timeout(timeout_s: float, grace: int) -> None:
    """Slurm sends USR1 `N` seconds before `--time`: that must be at or after the step's own
    timeout, or a short job is signalled as it starts, checkpoints, and requeues."""
    script = build_sbatch(_job(timeout_s=timeout_s), SlurmSettings(grace_seconds=grace))
    minutes = int(re.search(r"^#SBATCH --time=(\d+)$", script, re.M)[1])
    lead = int(re.search(r"^#SBATCH --signal=USR1@(\d+)$", script, re.M)[1])
    assert minutes * 60 - lead >= timeout_s, (minutes, lead)


def test_train_args_are_quoted_inside_the_task_shell(tmp_path: Path) -> None:
    job = TrainJob(name="j", train_args=["--config", "/it's here/c.json"])
    script = build_sbatch(job, SlurmSettings(python="python"))
    path = tmp_path / "s.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)  # valid bash
    line = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    inner = subprocess.run(
        ["bash", "-c", f"set -- {line.split(' bash -c ', 1)[1]}; printf '%s' \"$1\""],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert inner.endswith("-m kubellm.train --config '/it'\"'\"'s here/c.json'"), inner


def test_settings_from_the_pipeline_config() -> None:
    cfg = PipelineConfig(
        platform="slurm",
        runs_dir="/shared/runs",
        gpus_per_node=4,
        nproc_per_node=4,
        job_grace_seconds=120,
        fabric="roce",
        nccl_env={"NCCL_DEBUG": "WARN"},
        slurm_partition="gpu",
        slurm_account="team-a",
        job_max_restarts=5,
        batch_size=16,
    )
    s = SlurmSettings.from_config(cfg, "run-1")
    assert s.work_dir == "/shared/runs/slurm/run-1"
    assert (s.gpus_per_node, s.cpus_per_task, s.memory) == (4, 8, cfg.job_memory)
    assert (s.partition, s.account, s.grace_seconds, s.max_requeues) == ("gpu", "team-a", 120, 5)
    assert s.nccl_env["NCCL_IB_GID_INDEX"] == "3" and s.nccl_env["NCCL_DEBUG"] == "WARN"


def test_a_job_without_nodes_or_processes_is_refused() -> None:
    with pytest.raises(ValueError, match="nnodes and nproc_per_node must be >= 1"):
        build_sbatch(_job(nnodes=0))


def test_a_runs_jobs_carry_its_id_as_their_comment() -> None:
    # what the exit handler finds the run's jobs by (SlurmTrainer.release)
    settings = SlurmSettings.from_config(PipelineConfig(platform="slurm"), "run-7")
    assert settings.run_id == "run-7"
    assert "#SBATCH --comment=kubellm.dev/run=run-7\n" in build_sbatch(_job(), settings)
    assert "--comment" not in build_sbatch(_job(), SlurmSettings())
