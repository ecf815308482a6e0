"""The local tuner: optuna over the search space; each trial is a real training job.

The algorithms map onto optuna's samplers: random -> RandomSampler, tpe -> TPESampler,
bayesianoptimization -> GPSampler (a Gaussian process, as Katib's scikit-optimize), grid ->
GridSampler over the same evenly spaced points Katib's grid uses. Trials run one at a time
(one machine); early stopping is Katib's (cluster) only.
"""

from __future__ import annotations

import dataclasses

import optuna

from kubellm.backends.base import JobFailed, Trainer, TrainJob, Tuner, TuneRequest
from kubellm.tune.search import Trial, TuneResult, grid_points, grid_values, trial_args


class OptunaTuner(Tuner):
    """Optuna standing in for Katib: same search space, same trial entrypoint and metric lines."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def tune(self, request: TuneRequest) -> TuneResult:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(direction=request.goal, sampler=sampler(request))
        trials: list[Trial] = []
        max_failed = max_failed_trials(request)

        def objective(ot: optuna.Trial) -> float:
            params = suggest(ot, request)
            job = trial_job(request, ot.number, params)
            name = job.name
            try:
                result = self.trainer.run(job)
            except JobFailed as err:
                trials.append(Trial(name, params, None, "failed"))
                print(f"[{request.name}] trial {ot.number} failed: {err}", flush=True)
                failed = sum(t.state == "failed" for t in trials)
                if failed > max_failed:  # as Katib: the experiment fails
                    study.stop()
                raise optuna.TrialPruned(str(err)) from err
            if request.objective not in result.metrics:
                trials.append(Trial(name, params, None, "failed"))
                raise optuna.TrialPruned(f"{name} printed no {request.objective}= line")
            value = result.metrics[request.objective]
            trials.append(Trial(name, params, value, "succeeded"))
            print(f"[{request.name}] trial {ot.number}: {params} {request.objective}={value:.5g}")
            return value

        study.optimize(objective, n_trials=request.max_trials, timeout=request.timeout_s)
        return tune_result(request, trials)


def max_failed_trials(request: TuneRequest) -> int:
    """How many trials may fail before the search does (Katib's maxFailedTrialCount)."""
    if request.max_failed_trials is None:
        return request.max_trials - 1
    return request.max_failed_trials


def suggest(ot: optuna.Trial, request: TuneRequest) -> dict[str, float]:
    """Trial `ot`'s value of each parameter of the search space."""
    params: dict[str, float] = {}
    for p in request.space:
        if p.kind == "int":
            params[p.name] = ot.suggest_int(p.name, int(p.low), int(p.high), log=p.log)
        else:
            params[p.name] = ot.suggest_float(p.name, p.low, p.high, log=p.log)
    return params


def trial_job(request: TuneRequest, number: int, params: dict[str, float]) -> TrainJob:
    """Trial `number`'s training job: the template with one `--set` per parameter."""
    return dataclasses.replace(
        request.trial_job,
        name=f"{request.name}-trial-{number}",
        train_args=trial_args(request.trial_job.train_args, params, request.space),
    )


def tune_result(request: TuneRequest, trials: list[Trial]) -> TuneResult:
    """The best of `trials`, or JobFailed when none succeeded or more than
    max_failed_trials failed (as Katib fails the Experiment)."""
    done = [t for t in trials if t.value is not None]
    if not done:
        raise JobFailed(f"{request.name}: all {len(trials)} trials failed")
    failed = len(trials) - len(done)
    limit = max_failed_trials(request)
    if failed > limit:
        raise JobFailed(
            f"{request.name}: {failed} of {len(trials)} trials failed "
            f"(more than max_failed_trials={limit})"
        )
    sign = 1.0 if request.goal == "minimize" else -1.0
    best = min(done, key=lambda t: sign * (t.value or 0.0))
    assert best.value is not None
    return TuneResult(best.params, best.value, best.name, trials)


def sampler(request: TuneRequest) -> optuna.samplers.BaseSampler:
    """Optuna's counterpart of the request's algorithm, seeded like Katib's random_state."""
    seed = request.seed
    if request.algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if request.algorithm == "bayesianoptimization":
        return optuna.samplers.GPSampler(seed=seed)
    if request.algorithm == "grid":
        points = grid_points(request.max_trials, len(request.space))
        space = {p.name: grid_values(p, points) for p in request.space}
        return optuna.samplers.GridSampler(space, seed=seed)
    return optuna.samplers.TPESampler(seed=seed)
