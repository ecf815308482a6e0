"""The record_data stage: the prepared dataset in the run's MLflow lineage, as the
`prepare_data` stage run (counts, fingerprint, an MLflow dataset input, the manifest), and
whether it differs from what the current champion was trained on: a recurring run with
nothing new stops here instead of retraining on the same data.

It takes the run's ids, so it never comes from KFP's cache; prepare_data, which does the
expensive work, does (see stages/prepare_data.py).
"""

from __future__ import annotations

from pathlib import Path

from kubellm.data.artifact import load_manifest
from kubellm.stages.context import StageContext
from kubellm.stages.prepare_data import (
    CHANGED,
    UNCHANGED,
    Result,
    headline_of,
    metrics_of,
    report_of,
)
from kubellm.tracking import TAG_FINGERPRINT

__all__ = ["CHANGED", "TAG_UNCHANGED", "UNCHANGED", "Result", "run"]

TAG_SOURCE_FINGERPRINT = "kubellm.source_fingerprint"
TAG_UNCHANGED = "kubellm.data_unchanged"
# The MLflow stage run keeps prepare_data's name: lineage, summary and users look for it.
STAGE = "prepare_data"


def unchanged_since(ctx: StageContext, fingerprint: str) -> str:
    """'champion vN' when the champion was trained on data with this fingerprint, else ''."""
    mv = ctx.tracker.champion(ctx.cfg.model_name)
    if mv is None:
        return ""
    same = (mv.tags or {}).get(TAG_FINGERPRINT) == fingerprint
    return f"champion v{mv.version}" if same else ""


def run(ctx: StageContext, dataset_dir: str | Path) -> Result:
    """The dataset in this run's lineage, and whether it is new since the champion."""
    manifest = load_manifest(dataset_dir)
    fingerprint = manifest["data_fingerprint"]
    with ctx.stage(STAGE, shown="record_data") as run_id:
        since = unchanged_since(ctx, fingerprint)
        state = UNCHANGED if since and not ctx.cfg.force else CHANGED
        verdict = (
            f"data unchanged since {since}: training skipped (force=true retrains)"
            if state == UNCHANGED
            else (f"data unchanged since {since}; force=true: retraining" if since else "")
        )
        metrics = metrics_of(manifest)
        ctx.tracker.log(
            run_id,
            metrics=metrics,
            params=manifest["params"],
            tags={
                TAG_FINGERPRINT: fingerprint,
                TAG_SOURCE_FINGERPRINT: manifest["source_fingerprint"],
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
            report=report_of(manifest, verdict),
            headline=headline_of(manifest) + (f"; {verdict}" if verdict else ""),
            manifest=manifest,
            data_fingerprint=fingerprint,
            data_state=state,
        ),
        shown="record_data",
    )
