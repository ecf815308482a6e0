"""The register stage: an MLflow model version with its lineage, alias `challenger`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException

from kubellm.stages.context import StageContext, StageResult, markdown_table
from kubellm.tracking import CHALLENGER, TAG_FINGERPRINT, TAG_KFP_RUN


@dataclass
class Result(StageResult):
    version: str = ""


def lineage_tags(ctx: StageContext) -> dict[str, str]:
    """Where the model came from, read off the sibling stage runs of this pipeline run."""
    runs = ctx.stage_runs()
    tags = {
        TAG_KFP_RUN: ctx.kfp_run_id,
        "kubellm.pipeline_run": ctx.parent_run_id,
        "kubellm.trainer_image": ctx.cfg.trainer_image,
        "kubellm.serving_image": ctx.cfg.serving_image,
    }
    if "prepare_data" in runs:
        tags[TAG_FINGERPRINT] = runs["prepare_data"].data.tags.get(TAG_FINGERPRINT, "")
    if "train" in runs:
        tags["kubellm.training_run"] = runs["train"].info.run_id
    if "tune" in runs:
        tags["kubellm.best_trial"] = runs["tune"].data.tags.get("kubellm.best_trial", "")
    if "evaluate" in runs:
        tags["kubellm.evaluation_run"] = runs["evaluate"].info.run_id
        for key in ("kubellm.gate", "kubellm.gate_reason", "kubellm.gate_metric"):
            if key in runs["evaluate"].data.tags:
                tags[key] = runs["evaluate"].data.tags[key]
        for key in ("exact_match", "eval_loss", "perplexity"):
            if key in runs["evaluate"].data.metrics:
                tags[key] = f"{runs['evaluate'].data.metrics[key]:.6g}"
    return tags


def run(ctx: StageContext, model_dir: str | Path) -> Result:
    """Log the model directory as the run's artifacts and register it as a new version."""
    client = ctx.tracker.client
    name = ctx.cfg.model_name
    with ctx.stage("register") as run_id:
        client.log_artifacts(run_id, str(model_dir), "model")
        try:
            client.create_registered_model(name, description="kubellm causal LM")
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = f"{client.get_run(run_id).info.artifact_uri}/model"
        tags = lineage_tags(ctx)
        mv = client.create_model_version(name, source, run_id=run_id, tags=tags)
        client.set_registered_model_alias(name, CHALLENGER, mv.version)
        ctx.tracker.log(run_id, tags={"kubellm.model_version": mv.version, **tags})
    version = str(mv.version)
    return ctx.finish(
        "register",
        Result(
            report=markdown_table(
                "Registered model", [("name", name), ("version", version), *tags.items()]
            ),
            headline=f"{name} version {version} (alias challenger)",
            version=version,
        ),
    )
