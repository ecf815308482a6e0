"""stages.evaluate: held-out metrics, predictions for the smoke test, the gate, and the HTML
report (in KFP and on the MLflow evaluate run)."""

from __future__ import annotations

import html
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from kubellm.stages import evaluate
from kubellm.stages.context import StageContext
from stages.conftest import RUN, Chain, side_context

SVG = "{http://www.w3.org/2000/svg}"


def chain_evaluate_run(ctx: StageContext) -> Any:
    """The chain's own evaluate run: the first under its parent (tests add later ones)."""
    runs = ctx.tracker.children(ctx.parent_run_id)
    return next(r for r in runs if r.data.tags.get("kubellm.stage") == "evaluate")


def loss_curve(page: str) -> list[tuple[float, float]]:
    """The (x, y) points of the page's loss curve, read from its SVG (well-formed XML)."""
    [svg] = re.findall(r"<svg.*?</svg>", page, re.S)
    [line] = [e for e in ET.fromstring(svg).iter(f"{SVG}polyline")]
    return [(float(x), float(y)) for x, y in (p.split(",") for p in line.attrib["points"].split())]


def artifacts(ctx: StageContext, run_id: str) -> set[str]:
    return {a.path for a in ctx.tracker.client.list_artifacts(run_id)}


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
    candidate does: a same-settings retrain. A margin rejects it, and so does no margin: a
    tie is not an improvement, the champion stays (was: promoted at "improvement +0")."""
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
                str(out.with_suffix(".html")),
            )
    finally:
        client.delete_registered_model_alias(name, CHAMPION)
    strict, tie = results[0.05], results[0.0]
    for key in ("exact_match", "eval_loss", "perplexity", "bits_per_byte"):
        assert strict.metrics[f"champion_{key}"] == strict.metrics[key], key
    assert strict.decision == evaluate.REJECT
    assert f"vs champion v{version}" in strict.reason
    assert "improvement +0 < gate_margin 0.05" in strict.reason
    assert tie.decision == evaluate.REJECT, tie.reason
    assert "improvement +0 <= 0 (a tie keeps the champion)" in tie.reason
    assert "guard bits_per_byte" in tie.reason  # the default guard (gate_guards' default)
    tags = sides[0.0].stage_runs()["evaluate"].data.tags
    assert tags["kubellm.champion"] == f"champion v{version}"
    # the report compares both and shows both models' generations, kept on the run
    page = (chain.root / "champion-0.05.html").read_text()
    assert f"<th>champion v{version}</th><th>candidate − champion</th>" in page
    assert "improvement +0 &lt; gate_margin 0.05" in page
    samples = page[page.index('<table class="samples">') :]
    assert samples.count("<tr>") - 1 == min(8, int(strict.metrics["eval_examples"]))
    run_id = sides[0.05].stage_runs()["evaluate"].info.run_id
    assert "champion_predictions.json" in artifacts(sides[0.05], run_id)


def test_a_champion_that_does_not_load_stays_unless_incomparable_is_allowed(
    chain: Chain, ctx: StageContext, tmp_path: Path
) -> None:
    """A champion whose registered weights no longer load (here: a truncated safetensors
    file) is one the gate cannot compare: the candidate is rejected with that reason, the
    champion stays, and gate_allow_incomparable=true lets the absolute bar decide. Before,
    evaluate crashed, and so did every later run until someone moved the alias by hand."""
    import shutil

    from kubellm.tracking import CHAMPION

    broken = tmp_path / "broken"
    shutil.copytree(chain.artifact("model"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    client, name = ctx.tracker.client, ctx.cfg.model_name
    version = client.create_model_version(name, str(broken)).version
    client.set_registered_model_alias(name, CHAMPION, version)
    try:
        results = {}
        for allow in (False, True):
            side = side_context(ctx, f"broken-champion-{allow}", gate_allow_incomparable=allow)
            out = tmp_path / f"predictions-{allow}.json"
            results[allow] = evaluate.run(
                side, chain.artifact("model"), chain.artifact("dataset"), str(out)
            )
    finally:
        client.delete_registered_model_alias(name, CHAMPION)
    kept, allowed = results[False], results[True]
    assert kept.decision == evaluate.REJECT, kept.reason
    assert f"champion v{version} cannot be compared, so it stays" in kept.reason
    assert "(not measured: " in kept.reason and "Error" in kept.reason  # its error, named
    assert allowed.decision == evaluate.PROMOTE, allowed.reason  # gate_min_accuracy 0 here
    assert "gate_allow_incomparable=true: the absolute bar decides" in allowed.reason
    assert not any(k.startswith("champion_") for k in kept.metrics)


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
    # no task to score, but held-out text to continue: what the report shows and the smoke
    # test sends to the served model
    written = json.loads(out.read_text())
    assert 0 < len(written) <= 16
    assert all(w["prompt"] for w in written)
    # decoded from the held-out rows of this corpus (rows start mid-word: compare letters)
    assert set("".join(w["prompt"] for w in written)) <= set("".join(words) + " ")
    assert all(isinstance(w["prediction"], str) for w in written)


def test_the_html_report_draws_the_training_runs_loss_curve(
    chain: Chain, ctx: StageContext
) -> None:
    page = chain.artifact("report.html").read_text()
    train_run = ctx.stage_runs()["train"].info.run_id
    history = ctx.tracker.client.get_metric_history(train_run, "loss")
    assert len(history) >= 2  # the trainer logs loss every log_every steps
    curve = loss_curve(page)
    assert len(curve) == len(history) == len({m.step for m in history})
    xs = [x for x, _ in curve]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    assert train_run in page  # which run the curve comes from
    result = chain.results["evaluate"]
    assert f'<span class="badge">{result.decision.upper()}</span>' in page
    for reason in result.reason.split("; "):
        # each check marked with its outcome (evaluate/report.py _check_item)
        assert f'<span class="mark">&#10003; pass</span> {html.escape(reason)}</li>' in page
    assert "no champion yet" in page  # the chain's first evaluation has none
    # sample generations: the first evaluated prompt, as the candidate answered it
    first = json.loads(chain.artifact("predictions.json").read_text())[0]
    assert "<script" not in page
    assert html.escape(first["prompt"]) in page


def test_the_evaluate_run_keeps_the_reports_and_predictions(
    chain: Chain, ctx: StageContext, tmp_path: Path
) -> None:
    run_id = chain_evaluate_run(ctx).info.run_id
    assert artifacts(ctx, run_id) == {"report.html", "report.md", "predictions.json"}
    client = ctx.tracker.client
    got = Path(client.download_artifacts(run_id, "report.html", str(tmp_path)))
    assert got.read_text() == chain.artifact("report.html").read_text()  # the KFP one
    md = Path(client.download_artifacts(run_id, "report.md", str(tmp_path)))
    assert md.read_text() == chain.results["evaluate"].report
    pred = Path(client.download_artifacts(run_id, "predictions.json", str(tmp_path)))
    assert json.loads(pred.read_text()) == json.loads(
        chain.artifact("predictions.json").read_text()
    )


def test_without_a_train_run_the_report_says_so(chain: Chain, ctx: StageContext) -> None:
    side = side_context(ctx, "no-train")
    out = chain.root / "no-train.html"
    evaluate.run(
        side,
        chain.artifact("model"),
        chain.artifact("dataset"),
        str(out.with_suffix(".json")),
        str(out),
    )
    page = out.read_text()
    assert "<svg" not in page
    assert "No training loss history: this pipeline run has no train stage run" in page


def test_a_user_task_from_eval_data_is_what_exact_match_measures(
    chain: Chain, ctx: StageContext, tmp_path: Path
) -> None:
    """eval_data replaces the held-out examples: exact match is scored on the user's prompts
    against the user's answers (under the names a JSONL task usually has), and generation
    latency and tokens/s are measured on them; held-out loss still comes from the val split."""
    held_out = json.loads(chain.artifact("predictions.json").read_text())
    task = tmp_path / "task.jsonl"
    mine = [{"question": p["prompt"], "answer": f"{p['completion']}!"} for p in held_out[:5]]
    task.write_text("".join(json.dumps(m) + "\n" for m in mine))
    side = side_context(ctx, "user-task", eval_data=str(task))
    out = tmp_path / "out" / "p.json"
    result = evaluate.run(side, chain.artifact("model"), chain.artifact("dataset"), str(out))
    written = json.loads(out.read_text())
    assert [(w["prompt"], w["completion"]) for w in written] == [
        (m["question"], m["answer"]) for m in mine
    ]
    assert [w["correct"] for w in written] == [w["prediction"] == w["completion"] for w in written]
    assert result.metrics["exact_match"] == sum(w["correct"] for w in written) / 5
    assert result.metrics["eval_examples"] == 5
    assert result.metrics["gen_latency_ms"] > 0 and result.metrics["gen_tokens_per_sec"] > 0
    assert result.metrics["eval_loss"] == chain.results["evaluate"].metrics["eval_loss"]


def test_evaluate_measures_in_the_serving_dtype(
    chain: Chain, ctx: StageContext, monkeypatch: Any
) -> None:
    """The smoke test compares the server's answers with evaluate's, so evaluate loads the
    weights in the dtype the runtime serves them in (serving_dtype, its --dtype)."""
    import torch

    from kubellm.serve import generate

    loaded: list[Any] = []
    real_load = generate.load_model

    def spy(*args: Any, **kwargs: Any) -> Any:
        model, tokenizer = real_load(*args, **kwargs)
        loaded.append(next(model.parameters()).dtype)
        return model, tokenizer

    monkeypatch.setattr("kubellm.evaluate.metrics.load_model", spy)
    # model_copy skips validation: locally only float32 is allowed (kubellm serve's)
    bf16 = StageContext(
        ctx.cfg.model_copy(update={"serving_dtype": "bfloat16"}),
        ctx.tracker,
        ctx.parent_run_id,
        RUN,
    )
    out = chain.root / "bf16-predictions.json"
    result = evaluate.run(bf16, chain.artifact("model"), chain.artifact("dataset"), str(out))
    assert loaded and set(loaded) == {torch.bfloat16}
    assert result.metrics["eval_examples"] == chain.results["evaluate"].metrics["eval_examples"]
    assert len(json.loads(out.read_text())) == result.metrics["eval_examples"]


def test_load_model_refuses_a_dtype_that_is_not_a_float(chain: Chain) -> None:
    import pytest

    from kubellm.serve.generate import load_model

    with pytest.raises(ValueError, match="'int8' is not a floating-point torch dtype"):
        load_model(chain.artifact("model"), dtype="int8")


def test_the_evaluate_run_has_its_dataset_as_an_input(chain: Chain, ctx: StageContext) -> None:
    """What the figures were measured on, as an MLflow dataset input of the evaluate run
    (context `evaluation`): the prepared data's held-out split, its own name and digest,
    the full data fingerprint a tag, its profile the split's sizes; and what the register
    stage reads for the model's input example and default max_new_tokens."""
    run = ctx.tracker.client.get_run(chain_evaluate_run(ctx).info.run_id)
    [given] = run.inputs.dataset_inputs
    tags = {t.key: t.value for t in given.tags}
    prepared = chain.results["prepare_data"]
    assert tags["mlflow.data.context"] == "evaluation"
    assert tags["kubellm.data_fingerprint"] == prepared.data_fingerprint
    assert given.dataset.name == "tiny-stage-data-val" and len(given.dataset.digest) == 10
    assert json.loads(run.data.tags[evaluate.TAG_EVAL_DATASET]) == [
        given.dataset.name,
        given.dataset.digest,
    ]
    profile = json.loads(given.dataset.profile)
    manifest = prepared.manifest
    assert profile["records"] == manifest["records"]["val"] > 0
    assert profile["tokens"] == manifest["tokens"]["val"]
    first = json.loads(chain.artifact("predictions.json").read_text())[0]
    assert run.data.tags[evaluate.TAG_INPUT_EXAMPLE] == first["prompt"]
    assert run.data.tags[evaluate.TAG_MAX_NEW_TOKENS] == str(first["max_new_tokens"])
