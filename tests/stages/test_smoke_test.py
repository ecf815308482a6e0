"""stages.smoke_test: served answers must equal the evaluated ones; champion or rollback."""

from __future__ import annotations

import json

import pytest

from kubellm.backends.base import JobFailed
from kubellm.serve.client import Endpoint, is_ready
from kubellm.stages import smoke_test
from kubellm.stages.context import StageContext
from stages.conftest import Chain


def test_agreeing_answers_make_the_version_champion(chain: Chain, ctx: StageContext) -> None:
    version = chain.results["register"].version
    endpoint = chain.results["deploy"].endpoint
    result = smoke_test.run(ctx, endpoint, chain.artifact("predictions.json"), version)
    predictions = json.loads(chain.artifact("predictions.json").read_text())
    assert result.agreement == 1.0
    assert result.answer == predictions[0]["prediction"]
    assert result.metrics == {
        "agreement": 1.0,
        "served_exact_match": result.served_exact_match,
    }
    mv = ctx.tracker.client.get_model_version_by_alias("tiny-stage", "champion")
    assert str(mv.version) == version
    assert f"version {version} is champion" in result.report


def test_disagreeing_answers_roll_back(chain: Chain, ctx: StageContext) -> None:
    endpoint = chain.results["deploy"].endpoint
    wrong = json.loads(chain.artifact("predictions.json").read_text())
    for p in wrong:
        p["prediction"] = "not what the model says"
    path = chain.root / "wrong-predictions.json"
    path.write_text(json.dumps(wrong))
    with pytest.raises(JobFailed, match=r"match the evaluated model on 0/\d+ prompts"):
        smoke_test.run(ctx, endpoint, path, chain.results["register"].version)
    assert not is_ready(Endpoint("tiny-stage", endpoint)), "the server was not rolled back"
    assert ctx.stage_runs()["smoke_test"].info.status == "FAILED"
