"""kubellm lineage: a registered version's chain read back from MLflow (the stage chain's)."""

from __future__ import annotations

import json

import pytest

from kubellm.cli import main
from kubellm.commands.lineage import lineage
from kubellm.config import ConfigError
from kubellm.stages.context import StageContext
from stages.conftest import RUN, Chain


def test_the_chain_from_data_to_deployment(chain: Chain, ctx: StageContext) -> None:
    client, name = ctx.tracker.client, ctx.cfg.model_name
    version = chain.results["register"].version
    got = lineage(client, f"{name}@{version}")
    assert got["model"]["version"] == version
    assert got["data"]["fingerprint"] == chain.results["prepare_data"].data_fingerprint
    assert got["data"]["records_read"] == 600
    assert got["data"]["recipe_fingerprint"] == chain.results["prepare_data"].recipe_fingerprint
    recipe = got["data"]["recipe"]
    assert recipe["train_steps"] == str(ctx.cfg.train_steps) and recipe["kubellm_version"]
    assert got["tuning"]["best_trial"]  # the tune stage's best trial, by name
    train_run = client.get_model_version(name, version).tags["kubellm.training_run"]
    assert got["training"]["run"] == train_run
    assert got["training"]["train_loss"] == client.get_run(train_run).data.metrics["train_loss"]
    assert got["evaluation"]["gate"] == "promote"
    assert (
        got["evaluation"]["metrics"]["exact_match"]
        == (chain.results["evaluate"].metrics["exact_match"])
    )
    assert got["deployment"]["endpoint"].startswith("http://127.0.0.1:")
    assert got["pipeline"] == {"run": ctx.parent_run_id, "kfp_run_id": RUN, "version": ""}


def test_the_cli_prints_it_and_names_a_missing_version(
    chain: Chain, ctx: StageContext, capsys: pytest.CaptureFixture[str]
) -> None:
    uri, name = ctx.cfg.mlflow_tracking_uri, ctx.cfg.model_name
    version = chain.results["register"].version
    assert main(["lineage", f"{name}@{version}", "--tracking-uri", uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["version"] == version
    assert main(["lineage", f"{name}@{version}", "--tracking-uri", uri]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{name} v{version}")
    lines = ("data", "recipe", "tuning", "training", "evaluation", "gate", "deployment")
    for line in (*lines, "pipeline"):
        assert f"\n  {line} " in text, text
    assert main(["lineage", f"{name}@999", "--tracking-uri", uri]) == 2
    assert f"no model version '{name}@999'" in capsys.readouterr().err
    recipe = chain.results["prepare_data"].recipe_fingerprint
    assert f"\n  recipe      fingerprint {recipe[:16]}: train_steps {ctx.cfg.train_steps}," in text
    with pytest.raises(ConfigError, match="no model version 'nobody'"):
        lineage(ctx.tracker.client, "nobody")  # no such model, so no champion either
