"""stages.evaluate: held-out metrics, predictions for the smoke test, and the gate."""

from __future__ import annotations

import json

from kubellm.stages import evaluate
from kubellm.stages.context import StageContext
from stages.conftest import RUN, Chain, side_context


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


def test_the_champion_is_measured_on_the_candidates_data_and_must_be_beaten(
    chain: Chain, ctx: StageContext
) -> None:
    """The registered version (the same weights as the candidate) as champion: loaded from
    the registry and evaluated by the same code on the same data, it scores exactly what the
    candidate does, so a margin rejects the candidate and no margin lets a tie through."""
    from kubellm.tracking import CHAMPION

    client, name = ctx.tracker.client, ctx.cfg.model_name
    version = chain.results["register"].version
    client.set_registered_model_alias(name, CHAMPION, version)
    try:
        results, sides = {}, {}
        for margin in (0.05, 0.0):
            sides[margin] = side_context(ctx, f"champion-{margin}", gate_margin=margin)
            out = chain.root / f"champion-{margin}.json"
            results[margin] = evaluate.run(
                sides[margin],
                chain.artifact("model"),
                chain.artifact("dataset"),
                str(out),
            )
    finally:
        client.delete_registered_model_alias(name, CHAMPION)
    strict, tie = results[0.05], results[0.0]
    for key in ("exact_match", "eval_loss", "perplexity"):
        assert strict.metrics[f"champion_{key}"] == strict.metrics[key], key
    assert strict.decision == evaluate.REJECT
    assert f"vs champion v{version}" in strict.reason
    assert "improvement +0 < gate_margin 0.05" in strict.reason
    assert tie.decision == evaluate.PROMOTE, tie.reason
    tags = sides[0.0].stage_runs()["evaluate"].data.tags
    assert tags["kubellm.champion"] == f"champion v{version}"


def test_a_plain_text_corpus_goes_through_the_gate_on_perplexity(
    chain: Chain, ctx: StageContext
) -> None:
    """A JSONL of paragraphs has no prompt/answer pairs: the gate (auto) uses perplexity
    instead of reading a missing exact_match as 0 and rejecting every such run."""
    import random

    from kubellm.data.prepare import PrepareParams, prepare

    rng = random.Random(0)
    words = [
        "the",
        "model",
        "reads",
        "plain",
        "text",
        "and",
        "learns",
        "which",
        "word",
        "comes",
        "next",
        "in",
        "a",
        "line",
    ]
    src = chain.root / "paragraphs.jsonl"
    src.write_text(
        "\n".join(
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(40))}) for _ in range(300)
        )
    )
    data = chain.root / "plain-dataset"
    # the chain's model's own tokenizer, so its loss on these token ids means something
    prepare(
        PrepareParams(source=str(src), tokenizer=str(chain.artifact("model")), seq_len=16), data
    )
    out = chain.root / "plain-predictions.json"
    side = side_context(ctx, "plain-text")
    result = evaluate.run(side, chain.artifact("model"), data, str(out))
    assert "exact_match" not in result.metrics
    assert result.decision == evaluate.PROMOTE, result.reason
    assert (
        result.reason.startswith("perplexity ") and "<= gate_max_perplexity 1000" in result.reason
    )
    assert side.stage_runs()["evaluate"].data.tags["kubellm.gate_metric"] == "perplexity"
