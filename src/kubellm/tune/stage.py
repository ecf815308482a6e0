"""The tune stage: short real training runs over one search space; the best params win."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubellm import platform
from kubellm.stage import StageContext
from kubellm.tune.base import SearchParam, TuneRequest

# Kept narrow on purpose: trials are short, and a learning rate that wins a short race
# can diverge over a long run.
SEARCH_SPACE = [
    SearchParam("learning_rate", 1e-3, 4e-3, log=True),
    SearchParam("warmup_steps", 10, 100, kind="int"),
]


def run_tune(ctx: StageContext, dataset_dir: str | Path) -> dict[str, Any]:
    """Best hyperparameters as a dict (the learning rate as given when tune_trials=0)."""
    cfg = ctx.cfg
    with ctx.tracker.stage(ctx.parent_run_id, "tune") as run_id:
        if cfg.tune_trials == 0:
            best = {"learning_rate": cfg.learning_rate}
            ctx.tracker.log(run_id, params={"skipped": True, **best})
            return {"params": best, "best_trial": "", "objective": None}
        ws = ctx.workspace
        data = ws.share(dataset_dir, "dataset")
        trial_cfg = ctx.base_train_config(
            data,
            ws.dir("trials"),
            steps=cfg.tune_steps,
            log_every=max(1, cfg.tune_steps // 3),
            save_model=False,
        )
        request = TuneRequest(
            name=ctx.train_job("tune", trial_cfg).name,
            trial_job=ctx.train_job("tune", trial_cfg),
            space=SEARCH_SPACE,
            max_trials=cfg.tune_trials,
            objective="eval_loss",
            goal="minimize",
            seed=cfg.seed,
            timeout_s=cfg.job_timeout_minutes * 60.0,
        )
        result = platform.tuner(cfg).tune(request)
        for i, trial in enumerate(result.trials):
            with ctx.tracker.stage(run_id, f"trial-{i}") as trial_run:
                ctx.tracker.log(
                    trial_run,
                    metrics={"eval_loss": trial.value} if trial.value is not None else {},
                    params=trial.params,
                    tags={"kubellm.trial": trial.name, "kubellm.trial_state": trial.state},
                )
        ctx.tracker.log(
            run_id,
            metrics={"best_eval_loss": result.best_value, "trials": len(result.trials)},
            params={f"best_{k}": v for k, v in result.best_params.items()},
            tags={"kubellm.best_trial": result.best_trial},
        )
        print(f"tune: best {result.best_params} eval_loss={result.best_value:.4f}", flush=True)
        return {
            "params": result.best_params,
            "best_trial": result.best_trial,
            "objective": result.best_value,
        }


def params_json(result: dict[str, Any]) -> str:
    return json.dumps(result["params"], sort_keys=True)
