"""stages.train: the tuned hyperparameters reach the job; the model directory comes back."""

from __future__ import annotations

import json
import math

import pytest

from kubellm.config import ConfigError
from kubellm.stages import train
from kubellm.stages.context import StageContext
from stages.conftest import Chain


def test_model_directory_and_metrics(chain: Chain) -> None:
    result = chain.results["train"]
    model = chain.artifact("model")
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    for key in ("train_loss", "eval_loss", "perplexity", "tokens_per_sec"):
        assert math.isfinite(result.metrics[key]) and result.metrics[key] > 0, key
    assert result.model_metadata == {"framework": "transformers", "format": "safetensors"}
    assert result.job.startswith("tiny-stage-train-")
    assert "30 steps" in result.headline


def test_tuned_hyperparameters_reach_the_training_run(chain: Chain, ctx: StageContext) -> None:
    params = ctx.stage_runs()["train"].data.params
    tuned = chain.results["tune"].params
    assert float(params["learning_rate"]) == pytest.approx(tuned["learning_rate"])
    assert int(params["warmup_steps"]) == int(tuned["warmup_steps"])
    assert int(params["steps"]) == 30


def test_invalid_hyperparameters_fail_naming_the_field(chain: Chain, ctx: StageContext) -> None:
    bad = json.dumps({"learning_rate": 5.0})
    with pytest.raises(ConfigError, match=r"invalid learning_rate=5\.0"):
        train.run(ctx, chain.artifact("dataset"), bad, str(chain.root / "never"))
    assert not (chain.root / "never").exists()
