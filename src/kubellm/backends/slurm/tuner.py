"""The Slurm tuner: every trial of a search is a task of one array job.

Optuna samples all `max_trials` trials up front (they are the array's tasks), then the step
sends one `sbatch --array=0-N%parallel` script whose task index picks its trial
(kubellm.backends.slurm.script.build_sbatch with `trials`): Slurm runs at most
`tune_parallel` of them at a time, as Katib's parallelTrialCount. The step follows each task's
output file (`<name>-<array id>_<index>.out`), reads its state from `scontrol show job`, and
ends the search as the local tuner does (kubellm.backends.local.optuna_tuner.tune_result).

- Sampling ahead: TPE and the Gaussian process start with 10 random trials (optuna's
  n_startup_trials), so up to 10 trials are the ones the local tuner would sample, one by
  one, for the same seed; past 10 they stay random-sampled (no trial's result can guide a
  task already in the array).
- More than max_failed_trials failures cancel the rest of the array (Katib fails the
  Experiment); past the search's timeout, or when the step is stopped (SIGTERM), the array is
  `scancel`ed.
- A pre-empted task (exit 200) requeues itself as a plain job does, and keeps its index.

Example (on a login node):

    SlurmTuner(SlurmSettings(work_dir="/shared/runs/slurm", partition="gpu")).tune(request)
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import optuna

from kubellm.backends.base import JobFailed, TrainJob, Tuner, TuneRequest, sigterm_raises
from kubellm.backends.local.optuna_tuner import (
    max_failed_trials,
    sampler,
    suggest,
    trial_job,
    tune_result,
)
from kubellm.backends.slurm.script import SlurmSettings, build_sbatch, output_path
from kubellm.backends.slurm.trainer import (
    POLL_S,
    TERMINAL,
    Follow,
    cancel,
    cancel_when_stopped,
    drain,
    job_records,
    job_result,
    sbatch,
)
from kubellm.tune.search import Trial, TuneResult

# optuna's TPESampler and GPSampler sample this many trials at random before modelling.
STARTUP_TRIALS = 10


@dataclasses.dataclass(frozen=True)
class ArrayPlan:
    """A search as one array job: the sampled trials, in task order, the array's own job
    (the trials' template under the search's name) and its script."""

    trials: list[tuple[TrainJob, dict[str, float]]]
    template: TrainJob
    script: str


def plan(request: TuneRequest, settings: SlurmSettings) -> ArrayPlan:
    """Sample the request's trials (as OptunaTuner does, for its seed) and build the array."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction=request.goal, sampler=sampler(request))
    trials = []
    for number in range(request.max_trials):
        params = suggest(study.ask(), request)
        trials.append((trial_job(request, number, params), params))
    template = dataclasses.replace(request.trial_job, name=request.name)
    parallel = max(1, min(request.parallel_trials, request.max_trials))
    script = build_sbatch(template, settings, trials=[j for j, _ in trials], parallel=parallel)
    return ArrayPlan(trials, template, script)


class SlurmTuner(Tuner):
    """Runs a search as one Slurm array job (see the module docstring)."""

    def __init__(self, settings: SlurmSettings | None = None, echo: bool = True) -> None:
        self.settings = settings or SlurmSettings()
        self.echo = echo
        self.array_id: str | None = None  # the array being waited for (tests signal it)

    def tune(self, request: TuneRequest) -> TuneResult:
        if request.algorithm in ("tpe", "bayesianoptimization") and (
            request.max_trials > STARTUP_TRIALS
        ):
            print(
                f"[{request.name}] {request.algorithm}: the array's {request.max_trials} "
                f"trials are sampled before any runs; past the first {STARTUP_TRIALS} they "
                "are random, not guided by earlier results",
                flush=True,
            )
        arr = plan(request, self.settings)
        with sigterm_raises():
            array_id = sbatch(Path(self.settings.work_dir) / f"{request.name}.sbatch", arr.script)
            self.array_id = array_id
            out = output_path(self.settings, arr.template, array=True).replace("%A", array_id)
            logs = []
            for i, (job, _) in enumerate(arr.trials):
                path = Path(out.replace("%a", str(i)))
                print(f"[{job.name}] slurm job {array_id}_{i}; output {path}", flush=True)
                logs.append(Follow(path, job.name, self.echo))
            with cancel_when_stopped(request.name, array_id):
                trials = self._wait(request, arr, array_id, logs)
        return tune_result(request, trials)

    def _wait(
        self, request: TuneRequest, arr: ArrayPlan, array_id: str, logs: list[Follow]
    ) -> list[Trial]:
        """Each task's trial, as the tasks end; cancels the array past the timeout or when
        more trials failed than max_failed_trials allows."""
        deadline = time.monotonic() + request.timeout_s
        ended: dict[int, Trial] = {}
        limit = max_failed_trials(request)
        while True:
            for log in logs:
                log.poll()
            records = job_records(array_id)
            tasks = {int(r["ArrayTaskId"]): r for r in records if _index(r).isdigit()}
            for i, (job, params) in enumerate(arr.trials):
                if i in ended:
                    continue
                info = tasks.get(i)
                if info is not None and info.get("JobState") not in TERMINAL:
                    continue
                if info is None and not _forgotten(records, i):
                    continue
                ended[i] = self._trial(request, i, job, params, f"{array_id}_{i}", info, logs[i])
            failed = sum(t.state == "failed" for t in ended.values())
            stop = ""
            if failed > limit:
                stop = f"{failed} trials failed (more than max_failed_trials={limit})"
            elif time.monotonic() > deadline and len(ended) < len(arr.trials):
                stop = f"the search's timeout ({request.timeout_s:.0f}s) passed"
            if stop:  # as Katib: the Experiment ends, its running trials with it
                print(f"[{request.name}] {stop}: {cancel(array_id)}", flush=True)
                for i, (job, params) in enumerate(arr.trials):
                    ended.setdefault(i, Trial(job.name, params, None, "failed"))
            if len(ended) == len(arr.trials):
                return [ended[i] for i in range(len(arr.trials))]
            time.sleep(POLL_S)

    def _trial(
        self,
        request: TuneRequest,
        number: int,
        job: TrainJob,
        params: dict[str, float],
        task_id: str,
        info: dict[str, str] | None,
        log: Follow,
    ) -> Trial:
        drain(log)
        try:
            result = job_result(job, task_id, info, log)
        except JobFailed as err:
            print(f"[{request.name}] trial {number} failed: {err}", flush=True)
            return Trial(job.name, params, None, "failed")
        if request.objective not in result.metrics:
            print(f"[{request.name}] trial {number}: no {request.objective}= line", flush=True)
            return Trial(job.name, params, None, "failed")
        value = result.metrics[request.objective]
        print(f"[{request.name}] trial {number}: {params} {request.objective}={value:.5g}")
        return Trial(job.name, params, value, "succeeded")


def _index(record: dict[str, str]) -> str:
    return record.get("ArrayTaskId", "")


def _forgotten(records: list[dict[str, str]], index: int) -> bool:
    """Whether task `index` is in none of the array's records (ended, and past MinJobAge),
    rather than among its pending tasks (`ArrayTaskId=2-4%1` or `2,4`)."""
    for r in records:
        spec = _index(r).split("%")[0]
        for part in filter(None, spec.split(",")):
            low, _, high = part.partition("-")
            if low.isdigit() and int(low) <= index <= int(high or low):
                return False
    return True
