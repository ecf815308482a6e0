"""The evaluate stage: held-out metrics, the champion's for comparison, and the gate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException

from kubellm.evaluate.metrics import evaluate
from kubellm.stages.context import StageContext, StageResult, markdown_table, write_json
from kubellm.tracking import CHAMPION

PROMOTE = "promote"
REJECT = "reject"


@dataclass
class Result(StageResult):
    decision: str = REJECT  # the DAG's gate condition: PROMOTE or REJECT
    reason: str = ""


def champion_metric(ctx: StageContext, name: str) -> float | None:
    """The current champion's value of `name` (from its version tags), if there is one."""
    try:
        mv = ctx.tracker.client.get_model_version_by_alias(ctx.cfg.model_name, CHAMPION)
    except MlflowException:
        return None
    value = (mv.tags or {}).get(name)
    return float(value) if value is not None else None


def run(
    ctx: StageContext, model_dir: str | Path, dataset_dir: str | Path, predictions_path: str
) -> Result:
    """Metrics and the gate decision; writes predictions for the smoke test."""
    with ctx.stage("evaluate") as run_id:
        scored = evaluate(model_dir, dataset_dir)
        metrics: dict[str, float] = dict(scored["metrics"])
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
        write_json(predictions_path, scored["predictions"])
        ctx.tracker.log(
            run_id,
            metrics=metrics,
            tags={"kubellm.gate": decision, "kubellm.gate_reason": reason},
        )
    return ctx.finish(
        "evaluate",
        Result(
            metrics=metrics,
            report=markdown_table(
                "Evaluation", list(metrics.items()), f"Gate: **{decision}** ({reason})"
            ),
            headline=f"eval_loss {metrics['eval_loss']:.4g}, exact_match {accuracy:.3f}; "
            f"gate {decision}",
            decision=decision,
            reason=reason,
        ),
    )
