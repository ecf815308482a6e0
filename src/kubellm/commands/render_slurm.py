"""`kubellm render --target slurm`: the sbatch scripts a `platform=slurm` run submits.

Built by the code the stages run (`JobPlan`, `fabric_job`, `tune_request`) and the builder
the Slurm trainer sends (`build_sbatch`), so what is printed is what runs:

    kubellm render --target slurm --set gpus_per_node=8 --set num_nodes=2 \\
        --set slurm_partition=gpu --set runs_dir=/shared/kubellm-runs

The `tune` script is the search as one array job: the trials the run's seed samples, each
task's training arguments with its trial's `--set name=value` (kubellm.backends.slurm.tuner).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubellm.backends import resolve
from kubellm.backends.slurm.script import SlurmSettings, build_sbatch
from kubellm.backends.slurm.tuner import plan as array_plan
from kubellm.commands.render import RUN_ID
from kubellm.config import pipeline_config
from kubellm.stages.context import JobPlan
from kubellm.stages.preflight import fabric_job
from kubellm.stages.tune import tune_request


def render_slurm(overrides: dict[str, Any], kfp_run_id: str = RUN_ID) -> str:
    """Each script, headed by the stage that submits it."""
    cfg = resolve(pipeline_config({**overrides, "platform": "slurm"}))
    plan = JobPlan(cfg, kfp_run_id, None)
    settings = SlurmSettings.from_config(cfg, kfp_run_id)
    config_dir = Path(cfg.runs_dir) / "work" / kfp_run_id / "config"  # LocalWorkspace's
    fabric, train = fabric_job(plan), plan.train_job("train", config_dir / "train.json")
    scripts = [("preflight", fabric.name, build_sbatch(fabric, settings))]
    if cfg.tune_trials:
        request = tune_request(cfg, plan.train_job("tune", config_dir / "tune.json"))
        scripts.append(("tune", request.name, array_plan(request, settings).script))
    scripts.append(("train", train.name, build_sbatch(train, settings)))
    return "".join(f"# ---- {stage}: {name}.sbatch\n{text}" for stage, name, text in scripts)
