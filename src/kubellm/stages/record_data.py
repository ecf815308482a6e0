"""The record_data stage: the prepared dataset in the run's MLflow lineage, as the
`prepare_data` stage run (counts, data and recipe fingerprints, an MLflow dataset input,
the manifest), and whether this run has anything new to train: a recurring run stops here
instead of retraining when

- the champion was trained on the same data with the same recipe (kubellm.recipe: every
  training setting, base model, evaluation data, kubellm release), or
- an earlier run of the same data and recipe was rejected by the gate, with the same gate
  settings and against the same champion (so it would be rejected again).

force=true trains in both cases. A changed recipe on unchanged data retrains, and says so.

It takes the run's ids, so it never comes from KFP's cache; prepare_data, which does the
expensive work, does (see stages/prepare_data.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from kubellm.data.artifact import load_manifest
from kubellm.evaluate.gate import REJECT
from kubellm.recipe import Recipe, changed, gate_fingerprint, recipe_of
from kubellm.stages.context import StageContext
from kubellm.stages.prepare_data import (
    CHANGED,
    UNCHANGED,
    Result,
    headline_of,
    metrics_of,
    report_of,
)
from kubellm.tracking import (
    TAG_FINGERPRINT,
    TAG_GATE,
    TAG_GATE_FINGERPRINT,
    TAG_GATE_REASON,
    TAG_KFP_RUN,
    TAG_PARENT,
    TAG_RECIPE_FINGERPRINT,
    TAG_STAGE,
)

__all__ = ["CHANGED", "TAG_UNCHANGED", "UNCHANGED", "Result", "run"]

TAG_SOURCE_FINGERPRINT = "kubellm.source_fingerprint"
TAG_UNCHANGED = "kubellm.data_unchanged"
# On a prepare_data run that stopped for an earlier rejection: that run's KFP run id and
# the gate's reason, so the next run finds the rejection in its newest match.
TAG_REJECTED_IN = "kubellm.rejected_in"
TAG_REJECTED_REASON = "kubellm.rejected_reason"
# The MLflow stage run keeps prepare_data's name: lineage, summary and users look for it.
STAGE = "prepare_data"
# How many earlier prepare_data runs of the same data+recipe are looked at for a verdict.
LOOK_BACK = 20


@dataclass(frozen=True)
class Rejection:
    kfp_run_id: str
    reason: str


def _newest(ctx: StageContext, experiment_id: str, where: str, most: int = 1) -> list[Any]:
    return list(
        ctx.tracker.client.search_runs(
            [experiment_id],
            filter_string=where,
            max_results=most,
            order_by=["attributes.start_time DESC"],
        )
    )


def _sibling(ctx: StageContext, parent: str, stage: str, experiment_id: str = "") -> Any | None:
    """The newest `stage` run under pipeline run `parent`."""
    where = f"tags.`{TAG_PARENT}` = '{parent}' and tags.`{TAG_STAGE}` = '{stage}'"
    found = _newest(ctx, experiment_id or ctx.tracker.experiment_id, where)
    return found[0] if found else None


def recipe_change(ctx: StageContext, mv: Any, recipe: Recipe) -> str:
    """What differs from the recipe of the champion's pipeline run ('train_steps 30 -> 31'),
    read off its prepare_data run's `recipe.*` params; '' when they cannot be read."""
    parent = (mv.tags or {}).get("kubellm.pipeline_run", "")
    if not parent:
        return ""
    try:
        experiment_id = ctx.tracker.client.get_run(parent).info.experiment_id
    except MlflowException:
        return ""
    prepared = _sibling(ctx, parent, STAGE, experiment_id)
    if prepared is None:
        return ""
    theirs = {k: v for k, v in prepared.data.params.items() if k.startswith("recipe.")}
    return changed(theirs, recipe.params()) if theirs else ""


def already_rejected(
    ctx: StageContext, fingerprint: str, recipe: Recipe, gate: str
) -> Rejection | None:
    """The newest verdict on this data+recipe under this gate (and champion), when it was
    a rejection: earlier prepare_data runs with the three fingerprints, newest first, each
    answered by its sibling evaluate run's gate decision (a run that stopped for a
    rejection carries it on); runs that never reached the gate say nothing."""
    where = (
        f"tags.`{TAG_STAGE}` = '{STAGE}' and tags.`{TAG_FINGERPRINT}` = '{fingerprint}' "
        f"and tags.`{TAG_RECIPE_FINGERPRINT}` = '{recipe.fingerprint}' "
        f"and tags.`{TAG_GATE_FINGERPRINT}` = '{gate}'"
    )
    for prepared in _newest(ctx, ctx.tracker.experiment_id, where, LOOK_BACK):
        tags = prepared.data.tags
        parent = tags.get(TAG_PARENT, "")
        if not parent or parent == ctx.parent_run_id:
            continue
        if tags.get(TAG_REJECTED_IN):
            return Rejection(tags[TAG_REJECTED_IN], tags.get(TAG_REJECTED_REASON, ""))
        evaluation = _sibling(ctx, parent, "evaluate")
        judged = dict(evaluation.data.tags) if evaluation is not None else {}
        decision = judged.get(TAG_GATE, "")
        if decision == REJECT:
            return Rejection(tags.get(TAG_KFP_RUN, parent), judged.get(TAG_GATE_REASON, ""))
        if decision:  # promoted: the newest verdict on it was yes
            return None
    return None


def _stop(
    why: str, force: bool, rejected: Rejection | None = None
) -> tuple[str, str, Rejection | None]:
    """Training is skipped for `why`, unless force=true (then it retrains, saying so)."""
    if force:
        return CHANGED, f"{why}; force=true: retraining", None
    return UNCHANGED, f"{why}: training skipped (force=true retrains)", rejected


def verdict_of(
    ctx: StageContext, fingerprint: str, recipe: Recipe, mv: Any | None, gate: str
) -> tuple[str, str, Rejection | None]:
    """(data_state, what a person reads, the rejection this run stops for), given the
    champion version `mv` and the gate fingerprint."""
    force = ctx.cfg.force
    said = ""
    if mv is not None and (mv.tags or {}).get(TAG_FINGERPRINT) == fingerprint:
        since = f"champion v{mv.version}"
        theirs = (mv.tags or {}).get(TAG_RECIPE_FINGERPRINT, "")
        if theirs == recipe.fingerprint:
            matched = (
                f"data and recipe unchanged since {since} (data fingerprint "
                f"{fingerprint[:8]}…, recipe {recipe.fingerprint[:8]}…: {recipe.describe()})"
            )
            return _stop(matched, force)
        if not theirs:
            what = "its recipe is not recorded (registered before recipe fingerprints)"
        else:
            diff = recipe_change(ctx, mv, recipe)
            shown = diff or f"recipe {theirs[:8]}… -> {recipe.fingerprint[:8]}…"
            what = f"the recipe changed ({shown})"
        said = f"data unchanged since {since} but {what}: retraining"
    rejected = already_rejected(ctx, fingerprint, recipe, gate)
    if rejected is not None:
        why = (
            f"data and recipe already rejected in run {rejected.kfp_run_id} "
            f"(gate: {rejected.reason[:300] or 'no reason recorded'})"
        )
        return _stop(why, force, rejected)
    return CHANGED, said, None


def run(ctx: StageContext, dataset_dir: str | Path) -> Result:
    """The dataset and recipe in this run's lineage, and whether there is anything new to
    train (module docstring)."""
    manifest = load_manifest(dataset_dir)
    fingerprint = manifest["data_fingerprint"]
    recipe = recipe_of(ctx.cfg)
    with ctx.stage(STAGE, shown="record_data") as run_id:
        mv = ctx.tracker.champion(ctx.cfg.model_name)
        gate = gate_fingerprint(ctx.cfg, str(mv.version) if mv is not None else "")
        state, verdict, rejected = verdict_of(ctx, fingerprint, recipe, mv, gate)
        metrics = metrics_of(manifest)
        carried = (
            {TAG_REJECTED_IN: rejected.kfp_run_id, TAG_REJECTED_REASON: rejected.reason}
            if rejected is not None
            else {}
        )
        ctx.tracker.log(
            run_id,
            metrics=metrics,
            params={**manifest["params"], **recipe.params()},
            tags={
                TAG_FINGERPRINT: fingerprint,
                TAG_SOURCE_FINGERPRINT: manifest["source_fingerprint"],
                TAG_RECIPE_FINGERPRINT: recipe.fingerprint,
                TAG_GATE_FINGERPRINT: gate,
                **carried,
                **({TAG_UNCHANGED: verdict} if verdict else {}),
            },
        )
        ctx.tracker.log_dataset(run_id, ctx.cfg.model_name, manifest, "prepared")
        ctx.tracker.client.log_dict(run_id, manifest, "manifest.json")
    if verdict:  # on the pipeline run too: what the MLflow UI shows first
        ctx.tracker.log(ctx.parent_run_id, tags={TAG_UNCHANGED: verdict})
    return ctx.finish(
        STAGE,
        Result(
            metrics={k: float(v) for k, v in metrics.items()},
            report=report_of(manifest, verdict, recipe.fingerprint, recipe.describe()),
            headline=headline_of(manifest) + (f"; {verdict}" if verdict else ""),
            manifest=manifest,
            data_fingerprint=fingerprint,
            recipe_fingerprint=recipe.fingerprint,
            data_state=state,
        ),
        shown="record_data",
    )
