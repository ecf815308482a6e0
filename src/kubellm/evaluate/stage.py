"""The evaluate stage: held-out metrics, the champion's for comparison, and the gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from kubellm.evaluate.metrics import evaluate
from kubellm.stage import StageContext, write_json

PROMOTE = "promote"
REJECT = "reject"


def champion_metric(ctx: StageContext, name: str) -> float | None:
    """The current champion's exact match (from its version tags), if there is one."""
    try:
        mv = ctx.tracker.client.get_model_version_by_alias(ctx.cfg.model_name, "champion")
    except MlflowException:
        return None
    value = (mv.tags or {}).get(name)
    return float(value) if value is not None else None


def run_evaluate(
    ctx: StageContext, model_dir: str | Path, dataset_dir: str | Path, predictions_path: str | Path
) -> dict[str, Any]:
    """Returns metrics and the gate decision; writes predictions for the smoke test."""
    with ctx.tracker.stage(ctx.parent_run_id, "evaluate") as run_id:
        result = evaluate(model_dir, dataset_dir)
        metrics: dict[str, float] = dict(result["metrics"])
        accuracy = metrics.get("exact_match", 0.0)
        champion = champion_metric(ctx, "exact_match")
        if champion is not None:
            metrics["champion_exact_match"] = champion
        threshold = ctx.cfg.gate_min_accuracy
        decision = PROMOTE if accuracy >= threshold else REJECT
        reason = (
            f"exact_match {accuracy:.3f} {'>=' if decision == PROMOTE else '<'} "
            f"gate_min_accuracy {threshold:.3f}"
        )
        write_json(predictions_path, result["predictions"])
        ctx.tracker.log(
            run_id,
            metrics=metrics,
            tags={"kubellm.gate": decision, "kubellm.gate_reason": reason},
        )
        print(f"evaluate: {metrics}; gate: {decision} ({reason})", flush=True)
    return {"metrics": metrics, "decision": decision, "reason": reason}
