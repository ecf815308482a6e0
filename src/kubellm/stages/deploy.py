"""The deploy stage: serve a registered model version, fetched from the registry, and wait
until it answers readiness.

What is served is the registry's copy of the version (kubellm.tracking.registry), never a run's
workspace folder, so `kubellm promote` (a rollback) deploys an older version by the same
code: `registry_model_uri` then `serve_request` then the platform's Server.

Where a previous version serves (a cluster), the new one goes out as a canary with
`canary_traffic_percent` of the traffic; the smoke test calls the canary's own address and
then promotes it or rolls traffic back (kubellm.stages.smoke_test).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from kubellm.backends.base import Rollout, ServeRequest, ServeResources, Workspace
from kubellm.config import PipelineConfig
from kubellm.serve.layout import WEIGHTS_DIR
from kubellm.stages.context import StageContext, StageResult, markdown_table
from kubellm.tracking.registry import download_hf_dir, get_version, is_object_store, storage_uri

# The model version remembers where it was last served from (promote on a cluster reuses it).
TAG_SERVING_URI = "kubellm.serving_uri"


@dataclass
class Result(StageResult):
    endpoint: str = ""  # the new version's own address (the canary's): the smoke test's
    model_uri: str = ""  # what the server was given
    canary: bool = False  # a previous version serves the rest of the traffic
    previous: str = ""  # what that previous version is (a revision), "" on a first deploy


def serve_request(
    cfg: PipelineConfig, model_uri: str, kfp_run_id: str, version: str = ""
) -> ServeRequest:
    """The deployment of `model_uri` (registered version `version`) under the run's model
    name, with the pipeline's serving runtime, resources, replicas, placement, canary share
    and visibility.

    The Hugging Face runtime gets `serving_dtype` as its --dtype always (float32 by default:
    the checkpoint's dtype, which evaluate measured in), since its own default on a GPU is
    half precision; `kubellm serve` (custom) loads the checkpoint as it is, so it gets none.
    """
    hf = cfg.serving_runtime == "huggingface"
    return ServeRequest(
        name=cfg.model_name,
        model_uri=model_uri,
        namespace=cfg.namespace,
        image=cfg.serving_image,
        timeout_s=cfg.job_timeout_minutes * 60.0,
        run_tag=kfp_run_id,
        version=version,
        runtime=cfg.serving_runtime,
        canary_traffic_percent=cfg.canary_traffic_percent,
        resources=ServeResources(
            cpu=cfg.serving_cpu,
            memory=cfg.serving_memory,
            gpus=cfg.serving_gpus,
            min_replicas=cfg.serving_min_replicas,
            max_replicas=cfg.serving_max_replicas,
            node_selector=dict(cfg.serving_node_selector),
            tolerations=[dict(t) for t in cfg.serving_tolerations],
        ),
        dtype=cfg.serving_dtype if hf else "",
        max_model_len=cfg.serving_max_model_len if hf else 0,
        service_account=cfg.serving_service_account,
        cluster_local=cfg.serving_cluster_local,
    )


def registry_model_uri(ws: Workspace, client: MlflowClient, mv: Any) -> str:
    """Where the server reads model version `mv` from.

    With a workspace PVC (the server runs in the cluster), a version stored in an object store
    (s3://, gs://) is given to KServe as is: its `model/` folder, a complete Hugging Face
    directory (kubellm.tracking.registry logs the tokenizer files there too), which KServe's storage
    initializer copies to /mnt/models for either runtime. Any other store
    (mlflow-artifacts:/ behind the tracking server, file://) is downloaded here, as a Hugging
    Face directory, into the workspace (`serve/v<version>`), and served from there: a local
    path, or pvc://<claim>/... on a cluster.
    """
    source = storage_uri(client, mv)  # the files behind a models:/<model_id> source
    if ws.pvc_name and is_object_store(source):
        return f"{source.rstrip('/')}/{WEIGHTS_DIR}"
    path = download_hf_dir(client, mv, ws.dir("serve", f"v{mv.version}"))
    return ws.model_uri(path)


def run(ctx: StageContext, model_dir: str | Path, version: str) -> Result:
    """Serve version `version` of cfg.model_name as the registry holds it.

    `model_dir`, the train stage's KFP Model artifact, is not served (the registered copy
    is; the two hold the same weights, register logged the one from the other); it stays an
    input so the deploy step keeps its place after train in the DAG and its artifact lineage.
    """
    cfg = ctx.cfg
    client = ctx.tracker.client
    with ctx.stage("deploy") as run_id:
        mv = get_version(client, cfg.model_name, version)
        model_uri = registry_model_uri(ctx.backends.workspace, client, mv)
        request = serve_request(cfg, model_uri, ctx.kfp_run_id, str(mv.version))
        rollout = ctx.backends.server.deploy(request)
        endpoint = rollout.endpoint
        client.set_model_version_tag(cfg.model_name, str(mv.version), TAG_SERVING_URI, model_uri)
        ctx.tracker.log(
            run_id,
            params={
                "model_version": version,
                "model_uri": request.model_uri,
                "registry_source": str(mv.source),
                "registry_storage": storage_uri(client, mv),
                "serving_runtime": request.runtime,
                "serving_dtype": request.dtype or "checkpoint",
                "canary_traffic_percent": request.canary_traffic_percent if rollout.canary else 100,
            },
            tags={"kubellm.endpoint": endpoint.url},
        )
    return ctx.finish(
        "deploy",
        Result(
            report=markdown_table(
                "Deployment",
                [
                    ("model", f"{cfg.model_name} v{version}"),
                    ("from the registry", str(mv.source)),
                    ("served from", request.model_uri),
                    ("runtime", request.runtime),
                    ("traffic", _traffic(rollout, request)),
                    ("endpoint", endpoint.url),
                ],
            ),
            headline=f"{cfg.model_name} v{version} ready at {endpoint.url} "
            f"({_traffic(rollout, request)})",
            endpoint=endpoint.url,
            model_uri=request.model_uri,
            canary=rollout.canary,
            previous=rollout.previous,
        ),
    )


def _traffic(rollout: Rollout, request: ServeRequest) -> str:
    """The traffic line of the step's output: a canary's share, or why all traffic."""
    if rollout.full_rollout:
        return (
            f"all traffic: KServe {rollout.mode} mode here has no canary (spec.canary needs "
            f"KServe >= 0.20), so the new pods replaced {rollout.previous or 'the previous'} "
            "in a full rollout; the smoke test checks them, a failure restores it"
        )
    if not rollout.canary:
        return "all traffic (first deployment)"
    share = request.canary_traffic_percent
    where = f" (KServe {rollout.mode} mode)" if rollout.mode else ""
    return (
        f"canary{where}: {share}% of traffic, {100 - share}% stays on "
        f"{rollout.previous or 'the previous'}"
    )
