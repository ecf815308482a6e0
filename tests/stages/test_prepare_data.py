"""stages.prepare_data: the Dataset artifact, its counts as metrics, the fingerprint tag, the
MLflow dataset input, and the data_spec that is its KFP cache key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kubellm.config import PipelineConfig
from kubellm.data.records import DataError
from kubellm.stages.configs import data_spec
from kubellm.stages.context import StageContext
from stages.conftest import Chain, prepare, side_context


def test_counts_add_up_and_match_the_manifest(chain: Chain) -> None:
    result = chain.results["prepare_data"]
    manifest = json.loads((chain.artifact("dataset") / "manifest.json").read_text())
    assert result.manifest == manifest
    m = result.metrics
    assert m["records_read"] == 600
    dropped = sum(v for k, v in m.items() if k.startswith("dropped_"))
    assert m["records_kept"] + dropped == m["records_read"]
    assert m["records_train"] + m["records_val"] == m["records_kept"]
    assert m["tokens_train"] == manifest["tokens"]["train"] > 0
    assert result.fingerprint == manifest["source_fingerprint"]
    assert result.data_fingerprint[:12] in result.headline  # the data fingerprint
    assert f"| records read / kept | 600 / {int(m['records_kept'])} |" in result.report


def test_mlflow_run_has_the_fingerprint(chain: Chain, ctx: StageContext) -> None:
    run = ctx.stage_runs()["prepare_data"]
    result = chain.results["prepare_data"]
    assert run.data.tags["kubellm.data_fingerprint"] == result.data_fingerprint
    assert run.data.tags["kubellm.source_fingerprint"] == result.fingerprint
    assert run.data.metrics["records_read"] == 600
    assert run.info.status == "FINISHED"


def test_the_dataset_is_an_mlflow_dataset_input_with_its_manifest(
    chain: Chain, ctx: StageContext
) -> None:
    """mlflow.data lineage: the prepare run's input is the dataset (fingerprint as digest and
    tag, the user's source, split sizes as profile); the manifest and the stage's report
    are artifacts of the run."""
    client = ctx.tracker.client
    result = chain.results["prepare_data"]
    run = client.get_run(ctx.stage_runs()["prepare_data"].info.run_id)
    [given] = run.inputs.dataset_inputs
    tags = {t.key: t.value for t in given.tags}
    assert tags["mlflow.data.context"] == "prepared"
    assert tags["kubellm.data_fingerprint"] == result.data_fingerprint
    assert given.dataset.name == "tiny-stage-data"
    assert given.dataset.digest == result.data_fingerprint[:10]
    assert "synthetic" in given.dataset.source
    profile = json.loads(given.dataset.profile)
    assert profile["records"]["train"] == result.manifest["records"]["train"] > 0
    assert profile["tokens"]["val"] == result.manifest["tokens"]["val"] > 0
    logged = client.download_artifacts(run.info.run_id, "manifest.json", str(chain.root))
    assert json.loads(Path(logged).read_text()) == result.manifest
    report = client.download_artifacts(run.info.run_id, "report.md", str(chain.root))
    assert Path(report).read_text() == result.report  # every stage keeps its report


def _spec(**values: object) -> dict:
    return json.loads(data_spec(PipelineConfig.model_validate({"platform": "local", **values})))


def test_data_spec_is_the_data_and_nothing_run_specific() -> None:
    """prepare_data's only input, hence its KFP cache key (KFP hashes a task's input values,
    image and command: api/v2alpha1/cache_key.proto), must not move with training settings
    or names, and must move with every data parameter."""
    base = _spec(num_records=500)
    assert _spec(num_records=500, train_steps=7, learning_rate=0.01, model_name="other") == base
    assert _spec(num_records=500, experiment_name="nightly", gate_margin=0.1) == base
    for change in ({"num_records": 501}, {"seq_len": 64}, {"seed": 3}, {"val_fraction": 0.2}):
        assert _spec(**{"num_records": 500, **change}) != base, change


def test_data_spec_changes_when_the_files_at_the_same_path_change(tmp_path: Path) -> None:
    """New data under the same URI is a new cache key: a recurring run must not reuse the
    dataset of last week's files."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "one"}\n')
    first = _spec(data_source=str(src))
    assert [f["file"] for f in first["source_stamp"]] == [str(src / "a.jsonl")]
    assert _spec(data_source=str(src)) == first  # nothing changed: same key
    (src / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')  # grown in place
    grown = _spec(data_source=str(src))
    assert grown != first
    os.utime(src / "a.jsonl", (1, 1))  # same size, other mtime (a rewrite)
    assert _spec(data_source=str(src)) != grown
    (src / "b.jsonl").write_text('{"text": "three"}\n')  # a new file
    assert len(_spec(data_source=str(src))["source_stamp"]) == 2


def test_a_missing_source_fails_in_data_spec_naming_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"missing-\*\.jsonl.*matches no file"):
        _spec(data_source=str(tmp_path / "missing-*.jsonl"))


def test_data_unchanged_since_the_champion_stops_the_run_unless_forced(
    chain: Chain, ctx: StageContext
) -> None:
    """The same parameters and sources give the same data fingerprint; when the champion was
    trained on it with the same recipe, record_data says "unchanged" (the DAG stops) unless
    force=true; other preparation parameters make other data, another recipe (train_steps)
    on the same data retrains."""
    from kubellm.stages.record_data import CHANGED, TAG_UNCHANGED, UNCHANGED
    from kubellm.tracking import CHAMPION, TAG_FINGERPRINT, TAG_RECIPE_FINGERPRINT

    client, name = ctx.tracker.client, ctx.cfg.model_name
    version = chain.results["register"].version
    first = chain.results["prepare_data"]
    tags = client.get_model_version(name, version).tags
    assert tags[TAG_FINGERPRINT] == first.data_fingerprint
    assert tags[TAG_RECIPE_FINGERPRINT] == first.recipe_fingerprint
    client.set_registered_model_alias(name, CHAMPION, version)
    try:
        same_ctx = side_context(ctx, "unchanged")
        same = prepare(same_ctx, chain.root / "again")
        forced = prepare(side_context(ctx, "forced", force=True), chain.root / "forced")
        other = prepare(side_context(ctx, "other", seq_len=24), chain.root / "other")
        steps = ctx.cfg.train_steps
        longer = prepare(side_context(ctx, "longer", train_steps=steps + 1), chain.root / "longer")
    finally:
        client.delete_registered_model_alias(name, CHAMPION)
    assert same.data_fingerprint == first.data_fingerprint
    assert same.recipe_fingerprint == first.recipe_fingerprint
    assert same.data_state == UNCHANGED
    since = f"data and recipe unchanged since champion v{version} (data fingerprint "
    assert since in same.headline and "training skipped" in same.headline
    assert forced.data_state == CHANGED and "force=true: retraining" in forced.headline
    assert other.data_state == CHANGED and other.data_fingerprint != first.data_fingerprint
    assert longer.data_state == CHANGED and longer.data_fingerprint == first.data_fingerprint
    changed = f"the recipe changed (train_steps {steps} -> {steps + 1})"
    assert f"data unchanged since champion v{version} but {changed}" in longer.headline
    parent = client.get_run(same_ctx.parent_run_id)
    assert since in parent.data.tags[TAG_UNCHANGED]


def test_a_data_and_recipe_the_gate_rejected_stops_the_next_run_unless_forced(
    chain: Chain, ctx: StageContext
) -> None:
    """The real evaluate stage rejects a run (gate_min_accuracy 1.0, which the tiny model
    does not reach); the next run of the same data, recipe and gate stops naming that run
    and the gate's reason; force=true retrains. (train_steps 29: a recipe of its own, so no
    champion of the chain's data and recipe decides first.)"""
    from kubellm.stages import evaluate
    from kubellm.stages.record_data import CHANGED, UNCHANGED

    changes = {"gate_min_accuracy": 1.0, "train_steps": 29}
    rejected_ctx = side_context(ctx, "rejected", **changes)
    assert prepare(rejected_ctx, chain.root / "rejected").data_state == CHANGED
    judged = evaluate.run(
        rejected_ctx,
        chain.artifact("model"),
        chain.artifact("dataset"),
        str(chain.root / "rejected-predictions.json"),
    )
    assert judged.decision == "reject"
    reason = rejected_ctx.stage_runs()["evaluate"].data.tags["kubellm.gate_reason"]
    again = prepare(side_context(ctx, "rejected-again", **changes), chain.root / "again-r")
    assert again.data_state == UNCHANGED
    said = f"data and recipe already rejected in run rejected (gate: {reason[:300]}): "
    assert said + "training skipped (force=true retrains)" in again.headline
    forced_ctx = side_context(ctx, "rejected-forced", force=True, **changes)
    forced = prepare(forced_ctx, chain.root / "forced-r")
    assert forced.data_state == CHANGED and "force=true: retraining" in forced.headline
