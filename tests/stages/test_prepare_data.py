"""stages.prepare_data: the Dataset artifact, its counts as metrics, the fingerprint tag."""

from __future__ import annotations

import json

from kubellm.stages import prepare_data
from kubellm.stages.context import StageContext
from stages.conftest import Chain, side_context


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


def test_data_unchanged_since_the_champion_stops_the_run_unless_forced(
    chain: Chain, ctx: StageContext
) -> None:
    """The same parameters and sources give the same data fingerprint; when the champion was
    trained on it, prepare_data says "unchanged" (the DAG stops) unless force=true; other
    preparation parameters make other data."""
    from kubellm.stages.prepare_data import CHANGED, TAG_UNCHANGED, UNCHANGED
    from kubellm.tracking import CHAMPION, TAG_FINGERPRINT

    client, name = ctx.tracker.client, ctx.cfg.model_name
    version = chain.results["register"].version
    first = chain.results["prepare_data"]
    assert client.get_model_version(name, version).tags[TAG_FINGERPRINT] == first.data_fingerprint
    client.set_registered_model_alias(name, CHAMPION, version)
    try:
        same_ctx = side_context(ctx, "unchanged")
        same = prepare_data.run(same_ctx, chain.root / "again")
        forced = prepare_data.run(side_context(ctx, "forced", force=True), chain.root / "forced")
        other = prepare_data.run(side_context(ctx, "other", seq_len=24), chain.root / "other")
    finally:
        client.delete_registered_model_alias(name, CHAMPION)
    assert same.data_fingerprint == first.data_fingerprint
    assert same.data_state == UNCHANGED
    assert f"data unchanged since champion v{version}: training skipped" in same.headline
    assert forced.data_state == CHANGED and "force=true: retraining" in forced.headline
    assert other.data_state == CHANGED and other.data_fingerprint != first.data_fingerprint
    parent = client.get_run(same_ctx.parent_run_id)
    assert "data unchanged since champion" in parent.data.tags[TAG_UNCHANGED]
