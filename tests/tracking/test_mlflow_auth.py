"""The MLflow server of manifests/base with its authentication, run for real on loopback.

The server is started with the rendered Deployment's own command, arguments and
environment (`kubectl kustomize manifests/base`), its volumes emulated as the kubelet would
mount them: the ConfigMap `mlflow-auth` written to a directory, the data volume and /tmp as
empty directories, the Secret `mlflow-credentials` as the values of SECRET below. Only the
listening address differs (127.0.0.1 and a free port instead of 0.0.0.0:5000). So what is
tested is the manifest's start command, not a copy of it.

MLflow's basic-auth app needs Flask-WTF (`mlflow[auth]`); without it the server exits on
import and the fixture fails, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from kubellm.backends import resolve
from kubellm.backends.kubernetes.podspec import MLFLOW_SECRET, MLFLOW_SECRET_ENV
from kubellm.backends.local.model_server import free_port
from kubellm.config import PipelineConfig
from kubellm.stages import register
from kubellm.stages.context import StageContext, open_tracker
from kubellm.tracking import CHALLENGER, CHAMPION, TrackingUnauthorized
from tracking.mlflow_server import serving

REPO = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")
# The Secret as the cluster operator creates it (manifests/README.md, "Secrets").
SECRET = {"username": "kubellm-pipeline", "password": "correct-horse-battery-42"}
# A user the admin adds later: default_permission (READ) is all they have.
READER = ("reader", "reader-password-0042")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl renders the manifest")


@dataclass(frozen=True)
class AuthServer:
    url: str
    log: Path


def _rendered(kind: str, name: str) -> dict[str, Any]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(REPO / "manifests" / "base")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    (obj,) = [
        d
        for d in yaml.safe_load_all(out)
        if d and d["kind"] == kind and d["metadata"]["name"] == name
    ]
    return obj


def _tracking_env(username: str, password: str) -> dict[str, str]:
    """What a pipeline pod gets from the Secret: MLFLOW_TRACKING_* from its keys."""
    values = {"username": username, "password": password}
    return {env: values[key] for env, key in MLFLOW_SECRET_ENV.items() if key in values}


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    if importlib.util.find_spec("flask_wtf") is None:
        pytest.fail(
            "MLflow's basic-auth app needs Flask-WTF: pip install 'mlflow[auth]' "
            "(the image the manifest runs, ghcr.io/mlflow/mlflow:<tag>-full, has it)"
        )
    root = tmp_path_factory.mktemp("mlflow-auth")
    deployment = _rendered("Deployment", "mlflow")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}

    # The kubelet's mounts, as local directories; a ConfigMap's keys become its files.
    paths = {m["mountPath"]: root / m["name"] for m in container["volumeMounts"]}
    for mount in container["volumeMounts"]:
        local = paths[mount["mountPath"]]
        local.mkdir()
        config_map = volumes[mount["name"]].get("configMap")
        if config_map:
            data = _rendered("ConfigMap", config_map["name"])["data"]
            for key, text in data.items():
                (local / key).write_text(_local_paths(text, paths))

    port = free_port()
    argv = [*container["command"], *container["args"]]
    argv = [_local_paths(a, paths) for a in argv]
    argv = ["--host=127.0.0.1" if a.startswith("--host=") else a for a in argv]
    argv = [f"--port={port}" if a.startswith("--port=") else a for a in argv]

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # `python` and `mlflow` of the command: this venv's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # The server's background job runner (huey consumers) is not needed and costs seconds.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = _local_paths(var["value"], paths)
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == MLFLOW_SECRET, ref
            env[var["name"]] = SECRET[ref["key"]]

    with serving(argv, env, root, port) as (url, log_path):
        yield AuthServer(url=url, log=log_path)


def _local_paths(text: str, mounts: dict[str, Path]) -> str:
    """`text` with each mount path of the pod replaced by its local directory (one pass,
    longest first, so that a replaced path is never replaced again)."""
    if not mounts:
        return text
    alternatives = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
    return re.sub(rf"({alternatives})(?=/|$|\s|['\"])", lambda m: str(mounts[m.group(1)]), text)


@pytest.fixture
def with_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for env, value in _tracking_env(SECRET["username"], SECRET["password"]).items():
        monkeypatch.setenv(env, value)


@pytest.fixture
def without_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in MLFLOW_SECRET_ENV:
        monkeypatch.delenv(env, raising=False)


def test_health_answers_without_credentials_and_the_api_does_not(
    auth_server: AuthServer,
) -> None:
    """The kubelet's probes (/health, no credentials) pass; the REST API asks for them."""
    assert requests.get(f"{auth_server.url}/health", timeout=5).status_code == 200
    api = f"{auth_server.url}/api/2.0/mlflow/experiments/search?max_results=1"
    refused = requests.get(api, timeout=5)
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"].startswith("Basic")
    wrong = requests.get(api, auth=(SECRET["username"], "not-the-password!"), timeout=5)
    assert wrong.status_code == 401
    ok = requests.get(api, auth=(SECRET["username"], SECRET["password"]), timeout=5)
    assert ok.status_code == 200, ok.text


@pytest.mark.usefixtures("with_credentials")
def test_the_pipeline_tracks_and_registers_with_the_secrets_credentials(
    auth_server: AuthServer, tiny_model_dir: Path
) -> None:
    """kubellm's tracking (open_tracker, parent and stage runs, register's upload through the
    artifact proxy, the champion alias) works as the admin the Secret names."""
    cfg = resolve(PipelineConfig(platform="kubernetes", mlflow_tracking_uri=auth_server.url))
    tracker = open_tracker(cfg, "kfp-auth-1")
    parent = tracker.start_parent("pipeline-kfp-auth-1", {"seed": 0})
    ctx = StageContext(cfg, tracker, parent, "kfp-auth-1")
    with tracker.stage(parent, "evaluate") as run_id:
        tracker.log(run_id, metrics={"perplexity": 3.5})
    assert register.run(ctx, tiny_model_dir).version == "1"
    tracker.client.set_registered_model_alias(cfg.model_name, CHAMPION, "1")
    champion = tracker.champion(cfg.model_name)
    assert champion is not None and str(champion.version) == "1"
    assert str(tracker.client.get_model_version_by_alias(cfg.model_name, CHALLENGER).version)
    tracker.finish_parent(parent, succeeded=True)
    assert tracker.client.get_run(parent).info.status == "FINISHED"


def _champion_version(url: str, name: str) -> str:
    client = MlflowClient(tracking_uri=url)
    return str(client.get_model_version_by_alias(name, CHAMPION).version)


def test_without_credentials_the_champion_does_not_move(
    auth_server: AuthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod in the namespace without the Secret's credentials gets 401 when it tries to move
    `champion`, and a user with only default_permission (READ) gets 403; the alias stays."""
    name = "kubellm-auth-guarded"
    for env, value in _tracking_env(SECRET["username"], SECRET["password"]).items():
        monkeypatch.setenv(env, value)
    admin = MlflowClient(tracking_uri=auth_server.url)
    admin.create_registered_model(name)
    run = admin.create_run(admin.create_experiment("auth-guarded"))
    for _ in range(2):
        admin.create_model_version(name, f"{run.info.artifact_uri}/m", run.info.run_id)
    admin.set_registered_model_alias(name, CHAMPION, "1")
    from mlflow.server import get_app_client

    users = get_app_client("basic-auth", tracking_uri=auth_server.url)
    users.create_user(*READER)

    for env in MLFLOW_SECRET_ENV:
        monkeypatch.delenv(env, raising=False)
    anonymous = MlflowClient(tracking_uri=auth_server.url)
    with pytest.raises(MlflowException) as refused:
        anonymous.set_registered_model_alias(name, CHAMPION, "2")
    assert refused.value.get_http_status_code() == 401, refused.value.message

    for env, value in _tracking_env(*READER).items():
        monkeypatch.setenv(env, value)
    assert _champion_version(auth_server.url, name) == "1"  # READ: it may look
    with pytest.raises(MlflowException) as forbidden:
        MlflowClient(tracking_uri=auth_server.url).set_registered_model_alias(name, CHAMPION, "2")
    assert forbidden.value.get_http_status_code() == 403, forbidden.value.message

    for env, value in _tracking_env(SECRET["username"], SECRET["password"]).items():
        monkeypatch.setenv(env, value)
    assert _champion_version(auth_server.url, name) == "1", "the refused move happened anyway"


@pytest.mark.usefixtures("without_credentials")
def test_a_missing_credential_is_one_clear_error(auth_server: AuthServer) -> None:
    """A step whose pod lacks the Secret fails at open_tracker with one line that names the
    variables and the Secret, not with MLflow's retry noise or a raw 401 body."""
    cfg = resolve(PipelineConfig(platform="kubernetes", mlflow_tracking_uri=auth_server.url))
    with pytest.raises(TrackingUnauthorized) as err:
        open_tracker(cfg, "kfp-auth-2")
    message = str(err.value)
    assert "\n" not in message
    assert "HTTP 401" in message
    for word in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", MLFLOW_SECRET):
        assert word in message
    assert auth_server.url in message


def test_wrong_credentials_are_named_as_refused(
    auth_server: AuthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for env, value in _tracking_env(SECRET["username"], "not-the-password!").items():
        monkeypatch.setenv(env, value)
    cfg = resolve(PipelineConfig(platform="kubernetes", mlflow_tracking_uri=auth_server.url))
    with pytest.raises(TrackingUnauthorized, match="refuses the credentials") as err:
        open_tracker(cfg, "kfp-auth-3")
    assert "not-the-password!" not in str(err.value)
