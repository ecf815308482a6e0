"""stages.tune: trials are real training runs; the best parameters are in the search space."""

from __future__ import annotations

import json

from kubellm.stages import tune
from kubellm.stages.context import StageContext
from stages.conftest import RUN, Chain


def test_best_parameters_come_from_the_search_space(chain: Chain) -> None:
    result = chain.results["tune"]
    bounds = {p.name: (p.low, p.high) for p in tune.SEARCH_SPACE}
    assert set(result.params) == set(bounds)
    for name, value in result.params.items():
        low, high = bounds[name]
        assert low <= value <= high, f"{name}={value} outside [{low}, {high}]"
    assert json.loads(result.hparams_json) == result.params
    assert result.metrics["best_eval_loss"] == result.objective > 0
    assert result.best_trial.endswith("-trial-0")
    assert result.best_trial in result.report


def test_trials_are_nested_mlflow_runs(chain: Chain, ctx: StageContext) -> None:
    tune_run = ctx.stage_runs()["tune"]
    trials = ctx.tracker.children(tune_run.info.run_id)
    assert [t.data.tags["kubellm.trial_state"] for t in trials] == ["succeeded"]
    assert trials[0].data.metrics["eval_loss"] == chain.results["tune"].objective


def test_trials_export_nothing(chain: Chain, ctx: StageContext) -> None:
    """Parallel trials share one output_dir: an export from each would race (save_model=False)."""
    trials = ctx.backends.workspace.dir("trials")
    assert trials.is_dir() and not list(trials.rglob("*.safetensors"))


def test_no_trials_keeps_the_given_learning_rate(ctx: StageContext) -> None:
    skip = StageContext(
        ctx.cfg.model_copy(update={"tune_trials": 0, "learning_rate": 0.002}),
        ctx.tracker,
        ctx.parent_run_id,
        RUN,
    )
    result = tune.run(skip, "/nonexistent")  # no trial runs, so the data is never read
    assert result.params == {"learning_rate": 0.002}
    assert result.objective is None and result.metrics == {}
    assert "skipped" in result.headline
