"""The register stage: the model logged once as an MLflow transformers model
(kubellm.tracking.registry describes the layout) and registered from that LoggedModel
(`models:/<model_id>`) as a new version with its lineage, alias `challenger`. The
LoggedModel gets the evaluate stage's metrics with its evaluation dataset, and its input
example and default max_new_tokens from the data (the evaluate run's held-out prompts).

Serving, promotion and the champion's evaluation load that version from the registry, never
from a run's workspace folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubellm import __version__
from kubellm.stages.context import StageContext, StageResult, markdown_table
from kubellm.stages.evaluate import TAG_EVAL_DATASET, TAG_INPUT_EXAMPLE, TAG_MAX_NEW_TOKENS
from kubellm.tracking import CHALLENGER, TAG_FINGERPRINT, TAG_KFP_RUN, TAG_RECIPE_FINGERPRINT
from kubellm.tracking.registry import (
    PredictDefaults,
    link_evaluation,
    log_transformers_model,
    register_version,
    storage_uri,
)

# Without an evaluate run to read them from (a register call on its own): any prompt is
# valid input; this is the default corpus's, and its answers fit in 8 tokens.
FALLBACK = PredictDefaults("12+7=", 8, "kubellm defaults (no evaluate run)")
# The kubellm release whose pipeline made the version (KFP hands a step no pipeline-version
# id: its placeholders name the run, the task and the job, not the pipeline version).
TAG_KUBELLM_VERSION = "kubellm.version"
# The compiled pipeline (its KFP pipeline version name) as submit/schedule passed it.
TAG_PIPELINE_VERSION = "kubellm.pipeline_version"


@dataclass
class Result(StageResult):
    version: str = ""
    model_id: str = ""  # the MLflow LoggedModel (models:/<model_id>)
    source: str = ""  # the version's source: models:/<model_id>
    storage: str = ""  # where its files are (the LoggedModel's artifacts): serving fetches them


def lineage_tags(ctx: StageContext) -> dict[str, str]:
    """Where the model came from, read off the sibling stage runs of this pipeline run."""
    runs = ctx.stage_runs()
    tags = {
        TAG_KFP_RUN: ctx.kfp_run_id,
        "kubellm.pipeline_run": ctx.parent_run_id,
        "kubellm.trainer_image": ctx.cfg.trainer_image,
        "kubellm.serving_image": ctx.cfg.serving_image,
        TAG_KUBELLM_VERSION: __version__,
        TAG_PIPELINE_VERSION: ctx.cfg.pipeline_version,
    }
    if "prepare_data" in runs:  # what record_data compares a later run's data and recipe with
        prepared = runs["prepare_data"].data.tags
        tags[TAG_FINGERPRINT] = prepared.get(TAG_FINGERPRINT, "")
        tags[TAG_RECIPE_FINGERPRINT] = prepared.get(TAG_RECIPE_FINGERPRINT, "")
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


def predict_defaults(evaluation: Any | None) -> PredictDefaults:
    """The input example and default max_new_tokens the evaluate run recorded (a prompt of
    the data and the budget of its longest held-out completion), else FALLBACK."""
    if evaluation is None:
        return FALLBACK
    tags = evaluation.data.tags
    if TAG_INPUT_EXAMPLE not in tags or TAG_MAX_NEW_TOKENS not in tags:
        return FALLBACK
    return PredictDefaults(
        tags[TAG_INPUT_EXAMPLE],
        int(tags[TAG_MAX_NEW_TOKENS]),
        f"evaluate run {evaluation.info.run_id}",
    )


def eval_dataset(evaluation: Any | None) -> tuple[str, str] | None:
    """(name, digest) of the dataset the evaluate run measured on, if it recorded one."""
    shown = evaluation.data.tags.get(TAG_EVAL_DATASET) if evaluation is not None else None
    if not shown:
        return None
    name, digest = json.loads(shown)
    return str(name), str(digest)


def model_card(ctx: StageContext, tags: dict[str, str]) -> str:
    """The card saved with the model (instead of one fetched from the Hub)."""
    lines = [
        "---",
        "license: other",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "---",
        f"# {ctx.cfg.model_name}",
        "",
        f"A causal language model trained by kubellm pipeline run `{ctx.kfp_run_id}`.",
        "",
        *(f"- {k}: {v}" for k, v in sorted(tags.items()) if v),
        "",
    ]
    return "\n".join(lines)


def run(ctx: StageContext, model_dir: str | Path) -> Result:
    """Log the model once as an MLflow model under this stage's run and register it."""
    client = ctx.tracker.client
    name = ctx.cfg.model_name
    with ctx.stage("register") as run_id:
        tags = lineage_tags(ctx)
        evaluation = ctx.stage_runs().get("evaluate")
        logged = log_transformers_model(
            client,
            ctx.tracker.experiment_id,
            run_id,
            model_dir,
            defaults=predict_defaults(evaluation),
            card_text=model_card(ctx, tags),
            tags={TAG_KFP_RUN: ctx.kfp_run_id},
        )
        if evaluation is not None:
            link_evaluation(client, logged.model_id, evaluation, eval_dataset(evaluation))
        mv = register_version(client, name, logged, run_id, tags)
        client.set_registered_model_alias(name, CHALLENGER, mv.version)
        storage = storage_uri(client, mv)
        ctx.tracker.log(
            run_id,
            tags={"kubellm.model_version": mv.version, "kubellm.model_id": logged.model_id, **tags},
        )
    version = str(mv.version)
    rows = [("name", name), ("version", version), ("model id", logged.model_id)]
    return ctx.finish(
        "register",
        Result(
            report=markdown_table(
                "Registered model",
                [*rows, ("source", mv.source), ("storage", storage), *tags.items()],
            ),
            headline=f"{name} version {version} (alias challenger; models:/{logged.model_id})",
            version=version,
            model_id=logged.model_id,
            source=str(mv.source),
            storage=storage,
        ),
    )
