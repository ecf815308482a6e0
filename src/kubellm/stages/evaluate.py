"""The evaluate stage: the candidate's held-out metrics, the champion's on the same data (the
same code, the champion's weights from the registry), and the gate (kubellm.evaluate.gate)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubellm.evaluate.gate import PROMOTE, REJECT, Champion, decide
from kubellm.evaluate.metrics import evaluate
from kubellm.stages.context import StageContext, StageResult, markdown_table, write_json

__all__ = ["PROMOTE", "REJECT", "Result", "run"]


@dataclass
class Result(StageResult):
    decision: str = REJECT  # the DAG's gate condition: PROMOTE or REJECT
    reason: str = ""


def _same_tokenizer(model_dir: Path, dataset_dir: Path) -> bool:
    """Loss on the dataset's token ids means something only for a model of its tokenizer."""
    from kubellm.data.artifact import tokenizer_dir
    from kubellm.data.tokenizer import load_tokenizer

    try:
        theirs = load_tokenizer(model_dir).get_vocab()
    except (OSError, ValueError):
        return False
    return bool(theirs == load_tokenizer(tokenizer_dir(dataset_dir)).get_vocab())


def champion_on(ctx: StageContext, dataset_dir: Path) -> tuple[Champion | None, str]:
    """The current champion measured on this run's evaluation data; (None, why) without one."""
    mv = ctx.tracker.champion(ctx.cfg.model_name)
    if mv is None:
        return None, "no champion yet"
    import mlflow.artifacts

    with tempfile.TemporaryDirectory(prefix="champion-") as tmp:
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=mv.source, dst_path=tmp, tracking_uri=ctx.cfg.mlflow_tracking_uri
            )
        )
        scored: dict[str, Any] = evaluate(local, dataset_dir)
        metrics = dict(scored["metrics"])
        if not _same_tokenizer(local, dataset_dir):
            # its loss on another tokenizer's ids is meaningless; exact match is text
            metrics.pop("eval_loss", None)
            metrics.pop("perplexity", None)
    return Champion(str(mv.version), metrics), f"champion v{mv.version}"


def run(
    ctx: StageContext, model_dir: str | Path, dataset_dir: str | Path, predictions_path: str
) -> Result:
    """Metrics and the gate decision; writes predictions for the smoke test."""
    cfg = ctx.cfg
    with ctx.stage("evaluate") as run_id:
        scored = evaluate(model_dir, dataset_dir)
        metrics: dict[str, float] = dict(scored["metrics"])
        champion, about = champion_on(ctx, Path(dataset_dir))
        gate = decide(
            metrics,
            champion,
            asked=cfg.gate_metric,
            min_accuracy=cfg.gate_min_accuracy,
            max_perplexity=cfg.gate_max_perplexity,
            margin=cfg.gate_margin,
            guards=cfg.gate_guards,
        )
        logged = dict(metrics)
        if champion is not None:
            logged.update({f"champion_{k}": v for k, v in champion.metrics.items()})
        write_json(predictions_path, scored["predictions"])
        ctx.tracker.log(
            run_id,
            metrics=logged,
            tags={
                "kubellm.gate": gate.decision,
                "kubellm.gate_reason": gate.reason,
                "kubellm.gate_metric": gate.metric,
                "kubellm.champion": about,
            },
        )
    headline_value = metrics.get(gate.metric)
    shown = f"{gate.metric} {headline_value:.3f}" if headline_value is not None else gate.metric
    return ctx.finish(
        "evaluate",
        Result(
            metrics=logged,
            report=markdown_table(
                "Evaluation",
                list(logged.items()),
                f"Gate: **{gate.decision}** against {about} ({gate.reason})",
            ),
            headline=f"eval_loss {metrics['eval_loss']:.4g}, {shown}; gate {gate.decision}",
            decision=gate.decision,
            reason=gate.reason,
        ),
    )
