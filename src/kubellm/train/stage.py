"""The train stage: one training job with the tuned hyperparameters; the model comes back."""

from __future__ import annotations

import json
from pathlib import Path

from kubellm import platform
from kubellm.stage import StageContext


def run_train(
    ctx: StageContext, dataset_dir: str | Path, hparams_json: str, model_dir: str | Path
) -> dict[str, float]:
    cfg = ctx.cfg
    hparams = json.loads(hparams_json or "{}")
    with ctx.tracker.stage(ctx.parent_run_id, "train") as run_id:
        ws = ctx.workspace
        data = ws.share(dataset_dir, "dataset")
        out = ws.dir("model")
        train_cfg = ctx.base_train_config(
            data,
            out,
            steps=cfg.train_steps,
            log_every=max(1, cfg.train_steps // 10),
            # A retried step or a restarted PyTorchJob pod resumes from the newest checkpoint.
            checkpoint_dir=str(ws.dir("checkpoints", "train")),
            checkpoint_every=max(1, cfg.train_steps // 5),
            mlflow_run_id=run_id,
        ).model_copy(update=hparams)
        train_cfg = type(train_cfg).model_validate(train_cfg.model_dump())  # re-check hparams
        ctx.tracker.log(run_id, params={**train_cfg.model_dump(exclude={"model"}), **hparams})
        result = platform.trainer(cfg).run(ctx.train_job("train", train_cfg))
        ws.collect(out, model_dir)
        metrics: dict[str, float] = {
            k: result.metrics[k]
            for k in ("train_loss", "eval_loss", "perplexity", "tokens_per_sec")
            if k in result.metrics
        }
        ctx.tracker.log(run_id, tags={"kubellm.job": ctx.train_job("train", train_cfg).name})
    return metrics
