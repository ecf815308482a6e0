"""stages.register: a model version with lineage tags, alias challenger."""

from __future__ import annotations

from kubellm.stages.context import StageContext
from stages.conftest import RUN, Chain


def test_version_with_lineage(chain: Chain, ctx: StageContext) -> None:
    result = chain.results["register"]
    assert result.version == "1"
    client = ctx.tracker.client
    mv = client.get_model_version_by_alias("tiny-stage", "challenger")
    assert str(mv.version) == result.version
    runs = ctx.stage_runs()
    assert mv.tags["kubellm.data_fingerprint"] == chain.results["prepare_data"].data_fingerprint
    assert mv.tags["kubellm.gate"] == "promote" and mv.tags["kubellm.gate_reason"]
    assert mv.tags["kubellm.training_run"] == runs["train"].info.run_id
    assert mv.tags["kubellm.best_trial"] == chain.results["tune"].best_trial
    assert mv.tags["kubellm.kfp_run_id"] == RUN
    assert "version 1" in result.headline
