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


def test_the_training_run_records_its_dataset_config_and_loss_curve(
    chain: Chain, ctx: StageContext
) -> None:
    """The train run's lineage: the same MLflow dataset as the prepare run (MLflow links
    them by name and digest), the resolved TrainConfig the job read, and the training loss
    at every log_every step (30 steps, fewer than 100: every step)."""
    from pathlib import Path

    from kubellm.config import TrainConfig

    client = ctx.tracker.client
    runs = ctx.stage_runs()
    train_run = client.get_run(runs["train"].info.run_id)
    [prepared] = client.get_run(runs["prepare_data"].info.run_id).inputs.dataset_inputs
    [used] = train_run.inputs.dataset_inputs
    assert {t.key: t.value for t in used.tags}["mlflow.data.context"] == "training"
    assert (used.dataset.name, used.dataset.digest) == (
        prepared.dataset.name,
        prepared.dataset.digest,
    )
    path = client.download_artifacts(train_run.info.run_id, "train_config.json", str(chain.root))
    resolved = TrainConfig.model_validate_json(Path(path).read_text())
    assert resolved.steps == 30 and resolved.mlflow_run_id == train_run.info.run_id
    assert resolved.learning_rate == pytest.approx(chain.results["tune"].params["learning_rate"])
    history = client.get_metric_history(train_run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 31))


def test_invalid_hyperparameters_fail_naming_the_field(chain: Chain, ctx: StageContext) -> None:
    bad = json.dumps({"learning_rate": 5.0})
    with pytest.raises(ConfigError, match=r"invalid learning_rate=5\.0"):
        train.run(ctx, chain.artifact("dataset"), bad, str(chain.root / "never"))
    assert not (chain.root / "never").exists()


def logged_steps(steps: int, log_every: int) -> list[int]:
    """The steps kubellm.train.loop logs at: every log_every-th and the last."""
    return [s for s in range(1, steps + 1) if s % log_every == 0 or s == steps]


@pytest.mark.parametrize(
    ("steps", "log_every", "points"),
    [
        (1, 1, 1),
        (30, 1, 30),
        (99, 1, 99),
        (100, 1, 100),
        (250, 2, 125),
        (1500, 15, 100),
        (1501, 15, 101),
        (20_000, 200, 100),
    ],
)
def test_log_every_gives_about_100_loss_points_whatever_the_step_count(
    steps: int, log_every: int, points: int
) -> None:
    """Issue 25: the loss curve had 10 points whatever the run (`steps // 10`)."""
    assert train.log_every_for(steps) == log_every
    assert len(logged_steps(steps, log_every)) == points
    assert logged_steps(steps, log_every)[-1] == steps  # the final loss is kept
