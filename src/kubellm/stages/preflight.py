"""The preflight stage: validate every parameter, open the lineage, check the fabric."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubellm import backends
from kubellm.backends.base import TrainJob
from kubellm.config import PipelineConfig, pipeline_config
from kubellm.evaluate.tasks import load_task
from kubellm.redact import redact
from kubellm.stages.configs import data_spec
from kubellm.stages.context import (
    JobPlan,
    StageContext,
    StageResult,
    markdown_table,
    open_tracker,
)


@dataclass
class Result(StageResult):
    config: str = ""  # the resolved PipelineConfig as JSON: every later stage's input
    parent_run_id: str = ""
    data_spec: str = ""  # prepare_data's input (its cache key): see configs.data_spec


def fabric_args(cfg: PipelineConfig) -> list[str]:
    """The fabric check's flags: a GPU per process when the run asks for GPUs, RDMA
    required where the fabric profile asks for it (on the cluster's GPUs), and the
    bus-bandwidth floor when one is set."""
    args = ["--require-gpu"] if cfg.gpus_per_node else []  # as training will (nccl or fail)
    if cfg.fabric != "tcp" and cfg.platform == "kubernetes":
        args.append("--require-rdma")
    if cfg.min_busbw_gbps > 0:
        args += ["--min-busbw-gbps", f"{cfg.min_busbw_gbps:g}"]
    return args


def _kib(value: float | None) -> str:
    """A memlock_*_kib metric as `ulimit -l` prints it."""
    return "not reported" if value is None else "unlimited" if value < 0 else f"{value:g}"


def fabric_job(plan: JobPlan) -> TrainJob:
    """The all-reduce check, with the training topology, on the training launcher."""
    return plan.job("fabric", fabric_args(plan.cfg), module="kubellm.train.fabric", timeout_s=900.0)


def run(params: dict[str, Any], kfp_run_id: str) -> Result:
    """Validate `params` (the pipeline's parameters), start the parent MLflow run every
    stage logs under, and measure the fabric the training jobs will use."""
    cfg = backends.resolve(pipeline_config(params))
    tracker = open_tracker(cfg, kfp_run_id)
    # A retried preflight (same KFP run) carries on under the parent it already made.
    parent = tracker.find_parent()
    if parent is not None:
        print(f"preflight: reusing the MLflow parent run {parent} of this KFP run", flush=True)
    else:
        parent = tracker.start_parent(f"{cfg.model_name}-{kfp_run_id}", cfg.model_dump())
    ctx = StageContext(cfg, tracker, parent, kfp_run_id)
    with ctx.stage("preflight") as run_id:
        spec = data_spec(cfg)  # lists the data source: a wrong path fails here, in seconds
        if cfg.eval_data:
            # read in full: a bad line fails here, not after training
            load_task(cfg.eval_data, allow_http=cfg.allow_http_sources)
        job = ctx.backends.trainer.run(fabric_job(ctx.plan))
        fabric_metrics = ("allreduce", "memlock")  # memlock_*_kib: -1 is unlimited
        metrics = {k: v for k, v in job.metrics.items() if k.startswith(fabric_metrics)}
        tracker.log(
            run_id,
            metrics=metrics,
            params={"platform": cfg.platform, "mlflow_tracking_uri": cfg.mlflow_tracking_uri},
        )
    busbw = metrics.get("allreduce_busbw_gbps", 0.0)
    return ctx.finish(
        "preflight",
        Result(
            metrics=metrics,
            report=markdown_table(
                "Preflight",
                [
                    ("platform", cfg.platform),
                    ("MLflow", redact(cfg.mlflow_tracking_uri)),
                    ("parent run", parent),
                    ("processes", f"{cfg.num_nodes} x {cfg.nproc_per_node}"),
                    ("fabric", cfg.fabric),
                    ("all-reduce busbw (GB/s)", busbw),
                    ("memlock (KiB, lowest rank)", _kib(metrics.get("memlock_soft_kib"))),
                ],
            ),
            headline=f"config valid; all-reduce {busbw:.3g} GB/s; MLflow parent run {parent}",
            config=cfg.model_dump_json(),
            parent_run_id=parent,
            data_spec=spec,
        ),
    )
