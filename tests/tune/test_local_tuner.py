"""The local tuner's algorithms: optuna's sampler per Katib algorithm, grid points, failures.

Each trial here is a job whose metric is a known function of its parameters (a quadratic
printed as `eval_loss=`), so the search itself is what is tested; tests/stages/test_tune.py
runs the tuner on real training jobs.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kubellm.backends.base import JobFailed, JobResult, Trainer, TrainJob, TuneRequest
from kubellm.backends.local.optuna_tuner import OptunaTuner
from kubellm.tune.search import SearchParam, grid_points, grid_values

SPACE = [
    SearchParam("learning_rate", 1e-3, 4e-3, log=True),
    SearchParam("warmup_steps", 10, 100, kind="int"),
]


def assignments(args: list[str]) -> dict[str, float]:
    sets = [a for flag, a in itertools.pairwise(args) if flag == "--set"]
    return {k: float(v) for k, v in (s.split("=", 1) for s in sets)}


class QuadraticJob(Trainer):
    """Runs nothing: eval_loss is (lr - 2e-3)^2 * 1e6 + (warmup - 40)^2 / 1e4."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[dict[str, float]] = []

    def run(self, job: TrainJob) -> JobResult:
        p = assignments(job.train_args)
        self.seen.append(p)
        if self.fail:
            raise JobFailed(f"{job.name}: exit 1")
        loss = (p["learning_rate"] - 2e-3) ** 2 * 1e6 + (p["warmup_steps"] - 40) ** 2 / 1e4
        return JobResult(job.name, f"eval_loss={loss}\n", {"eval_loss": loss})


def request(**overrides: Any) -> TuneRequest:
    base: dict[str, Any] = {
        "name": "t",
        "trial_job": TrainJob(name="t", train_args=["--config", "c.json"]),
        "space": SPACE,
        "max_trials": 9,
    }
    return TuneRequest(**{**base, **overrides})


def test_grid_visits_the_grid_katib_would() -> None:
    trainer = QuadraticJob()
    result = OptunaTuner(trainer).tune(request(algorithm="grid"))
    points = grid_points(9, 2)
    assert points == 3
    expected = {
        (lr, w) for lr in grid_values(SPACE[0], points) for w in grid_values(SPACE[1], points)
    }
    seen = {(round(p["learning_rate"], 9), p["warmup_steps"]) for p in trainer.seen}
    assert seen == {(round(lr, 9), w) for lr, w in expected}  # all 9 points, once each
    assert {w for _, w in seen} == {10.0, 55.0, 100.0}
    assert result.best_params["warmup_steps"] == 55.0


@pytest.mark.parametrize("algorithm", ["random", "tpe", "bayesianoptimization"])
def test_samplers_stay_in_bounds_and_are_seeded(algorithm: str) -> None:
    runs = []
    for _ in range(2):
        trainer = QuadraticJob()
        OptunaTuner(trainer).tune(request(algorithm=algorithm, max_trials=4, seed=3))
        runs.append(trainer.seen)
    assert runs[0] == runs[1]  # the seed decides
    for p in runs[0]:
        assert 1e-3 <= p["learning_rate"] <= 4e-3
        assert 10 <= p["warmup_steps"] <= 100 and p["warmup_steps"].is_integer()


def test_max_failed_trials_ends_the_search() -> None:
    trainer = QuadraticJob(fail=True)
    with pytest.raises(JobFailed, match="trials failed"):
        OptunaTuner(trainer).tune(request(max_trials=9, max_failed_trials=1))
    assert len(trainer.seen) == 2  # the second failure is one too many
