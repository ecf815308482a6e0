"""The preflight stage: validate, open the lineage, check the fabric."""

from __future__ import annotations

from typing import Any

from kubellm import platform
from kubellm.config import PipelineConfig, pipeline_config
from kubellm.jobs import TrainJob, dns_name
from kubellm.tracking import Tracker


def fabric_job(cfg: PipelineConfig, kfp_run_id: str, pvc: str | None) -> TrainJob:
    return TrainJob(
        name=dns_name(cfg.model_name, "fabric", kfp_run_id[:12]),
        module="kubellm.preflight.fabric",
        train_args=["--mib", "4"],
        nnodes=cfg.num_nodes,
        nproc_per_node=cfg.nproc_per_node,
        timeout_s=600.0,
        image=cfg.trainer_image,
        namespace=cfg.namespace,
        workspace_pvc=pvc,
    )


def run_preflight(params: dict[str, Any], kfp_run_id: str) -> tuple[PipelineConfig, str]:
    """Returns the resolved config and the parent MLflow run every stage logs under."""
    cfg = pipeline_config(params).resolved()
    tracker = Tracker.open(cfg, kfp_run_id)  # fails here when the tracking server is down
    parent = tracker.start_parent(f"{cfg.model_name}-{kfp_run_id}", cfg.model_dump())
    with tracker.stage(parent, "preflight") as run_id:
        ws = platform.workspace(cfg, kfp_run_id)
        result = platform.trainer(cfg).run(fabric_job(cfg, kfp_run_id, ws.pvc_name))
        tracker.log(
            run_id,
            metrics={k: v for k, v in result.metrics.items() if k.startswith("allreduce")},
            params={"platform": cfg.platform, "mlflow_tracking_uri": cfg.mlflow_tracking_uri},
        )
    print(f"preflight: ok; parent MLflow run {parent}", flush=True)
    return cfg, parent
