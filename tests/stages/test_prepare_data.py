"""stages.prepare_data: the Dataset artifact, its counts as metrics, the fingerprint tag."""

from __future__ import annotations

import json

from kubellm.stages.context import StageContext
from stages.conftest import Chain


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
    assert result.fingerprint[:12] in result.headline
    assert f"| records read / kept | 600 / {int(m['records_kept'])} |" in result.report


def test_mlflow_run_has_the_fingerprint(chain: Chain, ctx: StageContext) -> None:
    run = ctx.stage_runs()["prepare_data"]
    assert run.data.tags["kubellm.data_fingerprint"] == chain.results["prepare_data"].fingerprint
    assert run.data.metrics["records_read"] == 600
    assert run.info.status == "FINISHED"
