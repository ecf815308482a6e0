"""The tune stage: short real training runs over one search space; the best params win."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kubellm.backends.base import TrainJob, TuneRequest
from kubellm.config import PipelineConfig
from kubellm.stages.configs import train_config
from kubellm.stages.context import StageContext, StageResult, markdown_table
from kubellm.tune.search import SearchParam

# Kept narrow on purpose: trials are short, and a learning rate that wins a short race
# can diverge over a long run.
SEARCH_SPACE = [
    SearchParam("learning_rate", 1e-3, 4e-3, log=True),
    SearchParam("warmup_steps", 10, 100, kind="int"),
]
OBJECTIVE = "eval_loss"


@dataclass
class Result(StageResult):
    params: dict[str, float] = field(default_factory=dict)  # what the train stage applies
    best_trial: str = ""
    objective: float | None = None

    @property
    def hparams_json(self) -> str:
        return json.dumps(self.params, sort_keys=True)


def tune_request(cfg: PipelineConfig, trial_job: TrainJob) -> TuneRequest:
    """The search the tuner runs: SEARCH_SPACE over trials shaped like `trial_job`."""
    return TuneRequest(
        name=trial_job.name,
        trial_job=trial_job,
        space=SEARCH_SPACE,
        max_trials=cfg.tune_trials,
        objective=OBJECTIVE,
        goal="minimize",
        seed=cfg.seed,
        timeout_s=cfg.job_timeout_minutes * 60.0,
        algorithm=cfg.tune_algorithm,
        parallel_trials=cfg.tune_parallel,
        max_failed_trials=None if cfg.tune_max_failed < 0 else cfg.tune_max_failed,
        early_stopping=cfg.tune_early_stopping,
    )


def run(ctx: StageContext, dataset_dir: str | Path) -> Result:
    """Best hyperparameters (the learning rate as given when tune_trials=0)."""
    cfg = ctx.cfg
    with ctx.stage("tune") as run_id:
        if cfg.tune_trials == 0:
            best = {"learning_rate": cfg.learning_rate}
            ctx.tracker.log(run_id, params={"skipped": True, **best})
            return ctx.finish(
                "tune",
                Result(
                    report="# Tuning\n\nSkipped (tune_trials=0).\n",
                    headline=f"skipped; learning_rate {cfg.learning_rate:g}",
                    params=best,
                ),
            )
        ws = ctx.backends.workspace
        data = ws.share(dataset_dir, "dataset")
        trial_cfg = train_config(
            cfg,
            data,
            ws.dir("trials"),
            steps=cfg.tune_steps,
            log_every=max(1, cfg.tune_steps // 3),
            save_model=False,
        )
        for p in SEARCH_SPACE:  # every value a trial can get is a valid TrainConfig
            for bound in (p.low, p.high):
                trial_cfg.with_values({p.name: bound})
        request = tune_request(cfg, ctx.train_job("tune", trial_cfg))
        result = ctx.backends.tuner.tune(request)
        for i, trial in enumerate(result.trials):
            with ctx.tracker.stage(run_id, f"trial-{i}") as trial_run:
                ctx.tracker.log(
                    trial_run,
                    metrics={OBJECTIVE: trial.value} if trial.value is not None else {},
                    params=trial.params,
                    tags={"kubellm.trial": trial.name, "kubellm.trial_state": trial.state},
                )
        metrics = {
            f"best_{OBJECTIVE}": result.best_value,
            **{f"best_{k}": float(v) for k, v in result.best_params.items()},
        }
        ctx.tracker.log(
            run_id,
            metrics={f"best_{OBJECTIVE}": result.best_value, "trials": len(result.trials)},
            params={f"best_{k}": v for k, v in result.best_params.items()},
            tags={"kubellm.best_trial": result.best_trial},
        )
    rows = [
        (t.name, f"{t.state}; {t.params}; {OBJECTIVE} {t.value if t.value is not None else '-'}")
        for t in result.trials
    ]
    shown = ", ".join(f"{k} {v:.4g}" for k, v in result.best_params.items())
    return ctx.finish(
        "tune",
        Result(
            metrics=metrics,
            report=markdown_table(
                "Tuning", rows, f"Best: {result.best_trial} ({OBJECTIVE} {result.best_value:.4g})"
            ),
            headline=f"best of {len(result.trials)} trials: {shown}; "
            f"{OBJECTIVE} {result.best_value:.4g}",
            params=result.best_params,
            best_trial=result.best_trial,
            objective=result.best_value,
        ),
    )
