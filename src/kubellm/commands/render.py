"""`kubellm render`: every Kubernetes object a cluster run would create, as YAML.

The objects come from the same code the stages run (`JobPlan`, `fabric_job`,
`tune_request`, `serve_request`) and the same builders the launchers send
(`pytorchjob_manifest` or, with trainer_backend=trainjob, `trainjob_manifest` and the
`training_runtime_manifest` it names, `build_experiment`, `build_inferenceservice`), so a platform
engineer can read them and check them against their own cluster's webhooks before the
first run:

    kubellm render --set gpus_per_node=8 --set fabric=rdma-ib | kubectl apply --dry-run=server -f -

Files a job reads (its TrainConfig) are written by the stage at run time; their paths are
shown as they will be on the workspace volume.
"""

from __future__ import annotations

from typing import Any

import yaml

from kubellm.backends import resolve
from kubellm.backends.kubernetes.inferenceservice import build_inferenceservice
from kubellm.backends.kubernetes.katib import build_experiment
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import pytorchjob_manifest
from kubellm.backends.kubernetes.trainjob import training_runtime_manifest, trainjob_manifest
from kubellm.backends.kubernetes.workspace import PvcWorkspace
from kubellm.config import PipelineConfig, pipeline_config
from kubellm.stages.context import JobPlan
from kubellm.stages.deploy import serve_request
from kubellm.stages.preflight import fabric_job
from kubellm.stages.tune import tune_request

# KFP assigns the run id at submission; the rendered names use this stand-in.
RUN_ID = "0123456789ab"


def objects(cfg: PipelineConfig, kfp_run_id: str = RUN_ID) -> list[tuple[str, dict[str, Any]]]:
    """(stage, body) of each object, in the order the stages create them."""
    cfg = resolve(cfg.model_copy(update={"platform": "kubernetes"}))
    plan = JobPlan(cfg, kfp_run_id, cfg.workspace_pvc)
    cluster = ClusterSettings.from_config(cfg, kfp_run_id)
    # The run's folder on the volume, as the stages lay it out (nothing is created here).
    ws = PvcWorkspace(cfg.workspace_pvc, kfp_run_id)
    v2 = cfg.trainer_backend == "trainjob"
    # The trainer backend runs preflight's fabric check and training; Katib's trials stay
    # PyTorchJobs (build_experiment).
    job_manifest = trainjob_manifest if v2 else pytorchjob_manifest
    out = []
    if v2:  # the cluster-scoped runtime every TrainJob names (manifests/cluster/trainer-v2)
        out.append(("preflight", training_runtime_manifest(cluster, cfg.trainer_image)))
    out.append(("preflight", job_manifest(fabric_job(plan), cluster)))
    if cfg.tune_trials:
        trial = plan.train_job("tune", ws.root / "config" / "tune.json")
        out.append(("tune", build_experiment(tune_request(cfg, trial), cluster)))
    train = plan.train_job("train", ws.root / "config" / "train.json")
    out.append(("train", job_manifest(train, cluster)))
    model_uri = ws.model_uri(ws.root / "serve" / "v1")
    out.append(("deploy", build_inferenceservice(serve_request(cfg, model_uri, kfp_run_id))))
    return out


def render(overrides: dict[str, Any], kfp_run_id: str = RUN_ID) -> str:
    """The objects as one multi-document YAML stream, each headed by the stage that makes it."""
    docs = []
    for stage, body in objects(pipeline_config(overrides), kfp_run_id):
        kind, name = body["kind"], body["metadata"]["name"]
        header = f"# {stage}: {kind} {name}"
        docs.append(header + "\n" + yaml.safe_dump(body, sort_keys=False))
    return "---\n".join(docs)
