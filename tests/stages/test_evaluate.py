"""stages.evaluate: held-out metrics, predictions for the smoke test, and the gate."""

from __future__ import annotations

import json

from kubellm.stages import evaluate
from kubellm.stages.context import StageContext
from stages.conftest import RUN, Chain


def test_promotes_at_the_threshold_and_writes_predictions(chain: Chain) -> None:
    result = chain.results["evaluate"]
    assert result.decision == evaluate.PROMOTE  # gate_min_accuracy=0 in this chain
    assert result.reason.endswith(">= gate_min_accuracy 0.000")
    assert 0.0 <= result.metrics["exact_match"] <= 1.0
    predictions = json.loads(chain.artifact("predictions.json").read_text())
    assert len(predictions) == result.metrics["eval_examples"] > 0
    assert {"prompt", "completion", "prediction", "max_new_tokens"} <= set(predictions[0])
    share = sum(p["prediction"] == p["completion"] for p in predictions) / len(predictions)
    assert share == result.metrics["exact_match"]
    assert f"Gate: **{evaluate.PROMOTE}**" in result.report


def test_rejects_above_what_the_model_reaches(chain: Chain, ctx: StageContext) -> None:
    reached = chain.results["evaluate"].metrics["exact_match"]
    assert reached < 1.0, "the tiny model is not expected to be perfect"
    strict = StageContext(
        ctx.cfg.model_copy(update={"gate_min_accuracy": 1.0}), ctx.tracker, ctx.parent_run_id, RUN
    )
    out = chain.root / "strict-predictions.json"
    result = evaluate.run(strict, chain.artifact("model"), chain.artifact("dataset"), str(out))
    assert result.decision == evaluate.REJECT
    assert result.reason == f"exact_match {reached:.3f} < gate_min_accuracy 1.000"
    tags = ctx.stage_runs()["evaluate"].data.tags  # the latest evaluate run
    assert (tags["kubellm.gate"], tags["kubellm.gate_reason"]) == (evaluate.REJECT, result.reason)
