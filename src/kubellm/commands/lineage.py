"""`kubellm lineage NAME[@alias|@version]`: where a registered model came from, read back
from MLflow: the data (fingerprint), tuning (best trial), training, evaluation and the gate,
deployment, and the pipeline run that made it.

Everything comes from what the stages recorded: the model version's tags (written by the
register stage) and the stage runs under the version's pipeline run.
"""

from __future__ import annotations

import json
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from kubellm.config import ConfigError
from kubellm.tracking import (
    CHAMPION,
    TAG_FINGERPRINT,
    TAG_KFP_RUN,
    TAG_RECIPE_FINGERPRINT,
    TAG_STAGE,
    Tracker,
)
from kubellm.tracking.registry import get_version


def resolve(client: MlflowClient, ref: str) -> Any:
    """NAME (its champion), NAME@ALIAS or NAME@VERSION -> the model version."""
    name, _, which = ref.partition("@")
    try:
        return get_version(client, name, which or CHAMPION)
    except ConfigError as err:
        raise ConfigError(f"no model version {ref!r}: {err}") from None


def _stage_runs(client: MlflowClient, parent: str) -> dict[str, Any]:
    if not parent:
        return {}
    try:
        run = client.get_run(parent)
    except MlflowException:
        return {}
    tracker = Tracker(client, run.info.experiment_id, run.data.tags.get(TAG_KFP_RUN, ""))
    # oldest first, so each stage maps to its latest run
    return {str(r.data.tags.get(TAG_STAGE, "")): r for r in tracker.children(parent)}


def lineage(client: MlflowClient, ref: str) -> dict[str, Any]:
    mv = resolve(client, ref)
    tags = dict(mv.tags or {})
    parent = tags.get("kubellm.pipeline_run", "")
    stages = _stage_runs(client, parent)

    # the runs the version names itself; the others are its pipeline run's stage runs
    named = {"train": "kubellm.training_run", "evaluate": "kubellm.evaluation_run"}
    for stage, tag in named.items():
        if tags.get(tag):
            try:
                stages[stage] = client.get_run(tags[tag])
            except MlflowException:
                stages.pop(stage, None)

    def run_of(stage: str) -> dict[str, Any]:
        run = stages.get(stage)
        if run is None:
            return {}
        return {
            "run_id": run.info.run_id,
            "status": run.info.status,
            "metrics": dict(run.data.metrics),
            "params": dict(run.data.params),
            "tags": {k: v for k, v in run.data.tags.items() if k.startswith("kubellm.")},
        }

    prepared, tuned, evaluated = run_of("prepare_data"), run_of("tune"), run_of("evaluate")
    deployed, smoke = run_of("deploy"), run_of("smoke_test")
    return {
        "model": {
            "name": mv.name,
            "version": str(mv.version),
            "aliases": list(getattr(mv, "aliases", []) or []),
            "source": mv.source,
        },
        "data": {
            "fingerprint": tags.get(TAG_FINGERPRINT, ""),
            "recipe_fingerprint": tags.get(TAG_RECIPE_FINGERPRINT, ""),
            "recipe": {
                k.removeprefix("recipe."): v
                for k, v in prepared.get("params", {}).items()
                if k.startswith("recipe.")
            },
            "prepare_run": prepared.get("run_id", ""),
            "source_fingerprint": prepared.get("tags", {}).get("kubellm.source_fingerprint", ""),
            "records_read": prepared.get("metrics", {}).get("records_read"),
            "records_kept": prepared.get("metrics", {}).get("records_kept"),
            "tokens_train": prepared.get("metrics", {}).get("tokens_train"),
        },
        "tuning": {
            "run": tuned.get("run_id", ""),
            "best_trial": tags.get("kubellm.best_trial", ""),
            "best_learning_rate": tuned.get("params", {}).get("best_learning_rate"),
            "best_eval_loss": tuned.get("metrics", {}).get("best_eval_loss"),
        },
        "training": {
            "run": tags.get("kubellm.training_run", ""),
            "train_loss": run_of("train").get("metrics", {}).get("train_loss"),
        },
        "evaluation": {
            "run": tags.get("kubellm.evaluation_run", ""),
            "metrics": {
                k: evaluated.get("metrics", {}).get(k)
                for k in ("exact_match", "eval_loss", "perplexity")
                if k in evaluated.get("metrics", {})
            },
            "gate": tags.get("kubellm.gate", ""),
            "gate_reason": tags.get("kubellm.gate_reason", ""),
            "compared_with": evaluated.get("tags", {}).get("kubellm.champion", ""),
        },
        "deployment": {
            "run": deployed.get("run_id", ""),
            "endpoint": deployed.get("tags", {}).get("kubellm.endpoint", ""),
            "smoke_test": smoke.get("status", ""),
            "served_exact_match": smoke.get("metrics", {}).get("served_exact_match"),
        },
        "pipeline": {
            "run": parent,
            "kfp_run_id": tags.get(TAG_KFP_RUN, ""),
            "version": tags.get("kubellm.pipeline_version", ""),
        },
    }


def _v(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    return str(value)


def format_text(chain: dict[str, Any]) -> str:
    m, d, t, tr = chain["model"], chain["data"], chain["tuning"], chain["training"]
    e, dep, p = chain["evaluation"], chain["deployment"], chain["pipeline"]
    aliases = f" ({', '.join(m['aliases'])})" if m["aliases"] else ""
    scores = ", ".join(f"{k} {_v(v)}" for k, v in e["metrics"].items()) or "-"
    lines = [
        f"{m['name']} v{m['version']}{aliases}: {m['source']}",
        f"  data        fingerprint {_v(d['fingerprint'])[:16]} (prepare_data run "
        f"{_v(d['prepare_run'])}): {_v(d['records_kept'])}/{_v(d['records_read'])} records "
        f"kept, {_v(d['tokens_train'])} train tokens",
        f"  recipe      fingerprint {_v(d['recipe_fingerprint'])[:16]}: train_steps "
        f"{_v(d['recipe'].get('train_steps'))}, learning_rate "
        f"{_v(d['recipe'].get('learning_rate'))}, base_model "
        f"{_v(d['recipe'].get('base_model'))}, kubellm {_v(d['recipe'].get('kubellm_version'))}",
        f"  tuning      best trial {_v(t['best_trial'])} (lr {_v(t['best_learning_rate'])}, "
        f"eval_loss {_v(t['best_eval_loss'])}), run {_v(t['run'])}",
        f"  training    run {_v(tr['run'])}: train_loss {_v(tr['train_loss'])}",
        f"  evaluation  run {_v(e['run'])}: {scores}; against {_v(e['compared_with'])}",
        f"  gate        {_v(e['gate'])} ({_v(e['gate_reason'])})",
        f"  deployment  run {_v(dep['run'])}: {_v(dep['endpoint'])}; smoke test "
        f"{_v(dep['smoke_test'])} (served exact match {_v(dep['served_exact_match'])})",
        f"  pipeline    MLflow run {_v(p['run'])}, KFP run {_v(p['kfp_run_id'])}, "
        f"pipeline version {_v(p['version'])}",
    ]
    return "\n".join(lines) + "\n"


def show(tracking_uri: str, ref: str, as_json: bool) -> str:
    chain = lineage(MlflowClient(tracking_uri=tracking_uri), ref)
    return json.dumps(chain, indent=2) + "\n" if as_json else format_text(chain)
