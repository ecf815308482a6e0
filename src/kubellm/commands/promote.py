"""`kubellm promote NAME@VERSION`: make a registered version the champion and serve it.

A rollback is the promotion of an older version. The version is served from the registry by
the deploy stage's own code path (kubellm.stages.deploy: `registry_model_uri`, then
`serve_request`, then the platform's Server), and the `champion` alias moves only once it
answers readiness, so the alias never names a version that is not being served.

    kubellm promote kubellm-tiny@3 --local  # a loopback model server, runs/mlflow.db
    kubellm promote kubellm-tiny@3 --tracking-uri http://mlflow.kubellm:5000 \\
        --set platform=kubernetes --set namespace=kubellm

A version the gate rejected is refused unless `force`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from kubellm.backends import resolve, select
from kubellm.backends.base import Workspace, workspace_mount
from kubellm.config import ConfigError, PipelineConfig, pipeline_config
from kubellm.evaluate.gate import REJECT
from kubellm.stages.deploy import TAG_SERVING_URI, registry_model_uri, serve_request
from kubellm.tracking import CHAMPION, champion_of, check_reachable
from kubellm.tracking.registry import (
    TAG_GATE,
    TAG_GATE_REASON,
    get_version,
    is_object_store,
    storage_uri,
)

TAG_PROMOTED = "kubellm.promoted"


@dataclass(frozen=True)
class Promotion:
    name: str
    version: str
    endpoint: str
    model_uri: str  # what the server was given
    previous: str  # the champion version before ("" without one)


def parse_ref(ref: str) -> tuple[str, str]:
    """NAME@VERSION (or NAME@ALIAS) -> (name, version)."""
    name, sep, version = ref.partition("@")
    if not sep or not name or not version:
        raise ConfigError(f"expected NAME@VERSION (e.g. kubellm-tiny@3), got {ref!r}")
    return name, version


def _model_uri(ws: Workspace, client: MlflowClient, mv: Any) -> str:
    """As the deploy stage does it, from wherever promote runs: on a cluster without the
    workspace PVC mounted here (a laptop), a version outside an object store is served from
    the copy its deploy step left on the PVC."""
    source = storage_uri(client, mv)
    if ws.pvc_name and not is_object_store(source) and not Path(workspace_mount()).is_dir():
        served = str((mv.tags or {}).get(TAG_SERVING_URI, ""))
        if served.startswith("pvc://"):
            return served
        raise ConfigError(
            f"{mv.name} version {mv.version} is stored at {source}, which KServe cannot fetch, "
            f"and no deploy step copied it onto the workspace PVC; run promote where "
            f"{workspace_mount()} is the mounted workspace PVC (a pod), or keep MLflow's "
            "artifacts in an object store (s3://, gs://)"
        )
    return registry_model_uri(ws, client, mv)


def promote(
    cfg: PipelineConfig, ref: str, force: bool = False, client: MlflowClient | None = None
) -> Promotion:
    """Serve registered version `ref` on cfg's platform, then make it the champion."""
    name, which = parse_ref(ref)
    cfg = pipeline_config({**cfg.model_dump(), "model_name": name})  # checks the name
    client = client or MlflowClient(cfg.mlflow_tracking_uri)
    mv = get_version(client, name, which)
    version = str(mv.version)
    tags = dict(mv.tags or {})
    if tags.get(TAG_GATE) == REJECT and not force:
        reason = tags.get(TAG_GATE_REASON) or "no reason recorded"
        raise ConfigError(
            f"{name} version {version} was rejected by the gate ({reason}); "
            "pass --force to promote it anyway"
        )
    current = champion_of(client, name)
    before = str(current.version) if current is not None else ""
    backends = select(cfg, f"promote-{name}")  # its own workspace folder, outside any run's
    model_uri = _model_uri(backends.workspace, client, mv)
    # no run tag: a promoted deployment belongs to no pipeline run, whose cleanup keeps it
    # the version comes up beside the current one (a canary on a cluster), then takes all
    # traffic: a version that does not become ready never displaces the one serving
    backends.server.deploy(serve_request(cfg, model_uri, "", version))
    endpoint = backends.server.promote(name, cfg.namespace)
    client.set_registered_model_alias(name, CHAMPION, version)
    client.set_model_version_tag(name, version, TAG_SERVING_URI, model_uri)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    note = f"{stamp} by kubellm promote" + (f" (champion was v{before})" if before else "")
    client.set_model_version_tag(name, version, TAG_PROMOTED, note + (" --force" if force else ""))
    return Promotion(name, version, endpoint.url, model_uri, before)


def promote_cli(
    ref: str, tracking_uri: str | None, overrides: dict[str, Any], force: bool = False
) -> int:
    """`kubellm promote`: prints the endpoint."""
    name, _ = parse_ref(ref)
    fixed = {"mlflow_tracking_uri": tracking_uri} if tracking_uri else {}
    cfg = resolve(pipeline_config({**overrides, "model_name": name, **fixed}))
    check_reachable(cfg.mlflow_tracking_uri)
    done = promote(cfg, ref, force)
    was = f" (was v{done.previous})" if done.previous else ""
    print(f"kubellm: {done.name} v{done.version} is champion{was}, served from {done.model_uri}")
    print(done.endpoint)
    return 0
