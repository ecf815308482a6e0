"""The train stage: one training job with the tuned hyperparameters; the model comes back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kubellm.data.artifact import load_manifest
from kubellm.stages.configs import train_config
from kubellm.stages.context import StageContext, StageResult, markdown_table

REPORTED = ("train_loss", "eval_loss", "perplexity", "tokens_per_sec")
# About this many points on the loss curve (MLflow's charts, the evaluate report), whatever
# the step count: between POINTS and 2 * POINTS - 1 for POINTS steps or more, every step below.
POINTS = 100


def log_every_for(steps: int, points: int = POINTS) -> int:
    """The trainer's log_every for a run of `steps` steps: about `points` metric lines (the
    final step always logs too: kubellm.train.loop)."""
    return max(1, steps // points)


@dataclass
class Result(StageResult):
    job: str = ""
    # KFP Model artifact metadata: what the directory holds
    model_metadata: dict[str, str] = field(
        default_factory=lambda: {"framework": "transformers", "format": "safetensors"}
    )


def run(ctx: StageContext, dataset_dir: str | Path, hparams_json: str, model_dir: str) -> Result:
    cfg = ctx.cfg
    hparams = json.loads(hparams_json or "{}")
    with ctx.stage("train") as run_id:
        ws = ctx.backends.workspace
        data = ws.share(dataset_dir, "dataset")
        out = ws.dir("model")
        train_cfg = train_config(
            cfg,
            data,
            out,
            steps=cfg.train_steps,
            log_every=log_every_for(cfg.train_steps),
            # A retried step or a restarted PyTorchJob pod resumes from the newest checkpoint.
            checkpoint_dir=str(ws.dir("checkpoints", "train")),
            checkpoint_every=max(1, cfg.train_steps // 5),
            mlflow_run_id=run_id,
        ).with_values(hparams)
        ctx.tracker.log(run_id, params={**train_cfg.model_dump(exclude={"model"}), **hparams})
        # what the job will read: the resolved config, and the dataset it trains on
        ctx.tracker.client.log_dict(run_id, train_cfg.model_dump(mode="json"), "train_config.json")
        manifest = load_manifest(dataset_dir)
        ctx.tracker.log_dataset(run_id, cfg.model_name, manifest, "training")
        job = ctx.train_job("train", train_cfg)
        result = ctx.backends.trainer.run(job)
        ws.collect(out, model_dir)
        metrics = {k: result.metrics[k] for k in REPORTED if k in result.metrics}
        ctx.tracker.log(run_id, tags={"kubellm.job": job.name})
    shown = ", ".join(f"{k} {metrics[k]:.4g}" for k in ("train_loss", "eval_loss") if k in metrics)
    return ctx.finish(
        "train",
        Result(
            metrics=metrics,
            report=markdown_table(
                "Training",
                [("job", job.name), ("steps", train_cfg.steps), *metrics.items()],
                f"Hyperparameters: `{json.dumps(hparams, sort_keys=True)}`",
            ),
            headline=f"{train_cfg.steps} steps; {shown}",
            job=job.name,
        ),
    )
