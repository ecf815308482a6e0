"""The authenticated kfp.Client that `kubellm submit` and `kubellm schedule` share.

One place decides where the endpoint, the bearer token and the UI link come from, and turns
the client's exceptions into one-line `ConfigError`s, so both commands behave alike:

- endpoint: `--endpoint` or `$KFP_ENDPOINT` (the ml-pipeline API, a port-forward of it, the
  Pipelines UI, which proxies `/apis`, or a Kubeflow dashboard URL ending in `/pipeline`);
- token: `--token-file PATH`, else `$KFP_TOKEN`, else kfp's own in-cluster convention,
  `$KF_PIPELINES_SA_TOKEN_PATH` or the projected token at
  /var/run/secrets/kubeflow/pipelines/token. A token never travels as a command-line value
  (`ps` and shell history would show it) nor as a pipeline parameter. kfp.Client skips the
  in-cluster token whenever a host is given, so it is honoured here;
- UI link: `--ui-url` or `$KF_PIPELINES_UI_ENDPOINT` (kfp's variable), else derived from the
  endpoint when that is certain, else none and a sentence saying how to get one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kubellm.config import ConfigError, PipelineConfig, parse_overrides, pipeline_config

TOKEN_ENV = "KFP_TOKEN"
# kfp.client.KF_PIPELINES_SA_TOKEN_ENV / KF_PIPELINES_SA_TOKEN_PATH (kfp/client/__init__.py)
SA_TOKEN_PATH_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
SA_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
UI_ENV = "KF_PIPELINES_UI_ENDPOINT"  # kfp.client.client.KF_PIPELINES_UI_ENDPOINT_ENV
API_PORTS = {8888, 8887}  # ml-pipeline's HTTP and gRPC ports: the API server, which has no UI


def add_kfp_args(p: argparse.ArgumentParser) -> None:
    """The endpoint, auth, experiment and ServiceAccount options of `submit` and `schedule`."""
    p.add_argument(
        "--endpoint",
        default=os.environ.get("KFP_ENDPOINT"),
        help="KFP API URL (default: $KFP_ENDPOINT), e.g. http://localhost:8888 "
        "(port-forward of svc/ml-pipeline) or https://kubeflow.example.com/pipeline",
    )
    p.add_argument(
        "--namespace",
        default=None,
        help="Kubeflow profile namespace (multi-user Kubeflow Pipelines)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help=f"file holding the bearer token (default: ${TOKEN_ENV}, else "
        f"${SA_TOKEN_PATH_ENV} or {SA_TOKEN_PATH} when present, as kfp does in-cluster)",
    )
    p.add_argument(
        "--ui-url",
        default=None,
        help=f"Pipelines UI base URL for the printed link (default: ${UI_ENV}; derived from "
        "--endpoint when it is a UI or a Kubeflow dashboard URL)",
    )
    p.add_argument("--experiment", default="kubellm", help="KFP experiment name")
    p.add_argument(
        "--service-account",
        default="kubellm-pipeline",
        help="ServiceAccount the steps run as (its Role lets them create jobs; "
        "manifests/base/rbac.yaml); empty: the profile's default",
    )


@dataclass(frozen=True)
class Token:
    """Where the bearer token comes from: a value (from the environment) or a file."""

    value: str | None = None
    path: str | None = None
    source: str = ""


def resolve_token(token_file: str | None, env: dict[str, str] | None = None) -> Token | None:
    """The bearer token to send, or None (an unauthenticated port-forward, say)."""
    env = dict(os.environ) if env is None else env
    if token_file:
        return Token(path=_readable_token(token_file, "--token-file"), source="--token-file")
    if env.get(TOKEN_ENV, "").strip():
        return Token(value=env[TOKEN_ENV].strip(), source=f"${TOKEN_ENV}")
    if env.get(SA_TOKEN_PATH_ENV):
        path = _readable_token(env[SA_TOKEN_PATH_ENV], f"${SA_TOKEN_PATH_ENV}")
        return Token(path=path, source=f"${SA_TOKEN_PATH_ENV}")
    if Path(SA_TOKEN_PATH).is_file():
        return Token(path=_readable_token(SA_TOKEN_PATH, SA_TOKEN_PATH), source=SA_TOKEN_PATH)
    return None


def _readable_token(path: str, named: str) -> str:
    try:
        text = Path(path).read_text().strip()
    except OSError as err:
        raise ConfigError(f"cannot read the KFP token file {path} ({named}): {err}") from None
    if not text:
        raise ConfigError(f"the KFP token file {path} ({named}) is empty")
    return path


def ui_base(endpoint: str, ui_url: str | None) -> str | None:
    """The Pipelines UI base URL that run links hang off, or None when it cannot be known.

    kfp.Client uses the API host itself; that is right only when the host is the UI (which
    proxies /apis) or the dashboard. The API server (ml-pipeline, ports 8888/8887) serves no
    UI, and a Kubeflow dashboard's `/pipeline` prefix opens the UI outside the dashboard
    frame, which lives under `/_/pipeline/`.
    """
    explicit = ui_url or os.environ.get(UI_ENV)
    if explicit:
        return explicit.rstrip("/") if "://" in explicit else f"http://{explicit.rstrip('/')}"
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    host = parts.hostname or ""
    if parts.path.rstrip("/").endswith("/pipeline"):
        prefix = parts.path.rstrip("/")[: -len("/pipeline")]
        return f"{parts.scheme}://{parts.netloc}{prefix}/_/pipeline"
    if parts.port in API_PORTS or host == "ml-pipeline" or host.startswith("ml-pipeline."):
        return None
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def run_link(endpoint: str, ui_url: str | None, run_id: str) -> str:
    """The line to print for a run: its UI link, or plainly why there is none."""
    base = ui_base(endpoint, ui_url)
    if base is None:
        return (
            f"no UI link: {endpoint} is the KFP API server, which has no UI; pass --ui-url "
            f"(or set {UI_ENV}) to your Pipelines UI, e.g. http://localhost:8080 after "
            "`kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80`"
        )
    return f"{base}/#/runs/details/{run_id}"


def recurring_run_link(endpoint: str, ui_url: str | None, recurring_run_id: str) -> str | None:
    """The UI page of a recurring run (`#/recurringrun/details/ID`), when the UI is known."""
    base = ui_base(endpoint, ui_url)
    return None if base is None else f"{base}/#/recurringrun/details/{recurring_run_id}"


def version_name(pipeline: str) -> str:
    """The pipeline version a compiled YAML is: its content hash (`kubellm schedule` uploads
    it under this name; every run carries it as `pipeline_version` for the registry)."""
    return "sha256-" + hashlib.sha256(Path(pipeline).read_bytes()).hexdigest()[:16]


def pipeline_arguments(pipeline: str, overrides: list[str]) -> dict[str, Any]:
    """The run's parameters from `--set`, validated as preflight validates them and typed as
    the pipeline declares them, before anything is sent (`submit` and `schedule`), plus the
    pipeline version it is (a step cannot learn it from KFP: no placeholder names it)."""
    if not Path(pipeline).is_file():
        raise ConfigError(f"pipeline {pipeline} not found (run `kubellm compile`)")
    values = parse_overrides(overrides, PipelineConfig)
    values.setdefault("pipeline_version", version_name(pipeline))
    cfg = pipeline_config(values)
    return {k: getattr(cfg, k) for k in values}  # `0` for a float field goes out as 0.0


def connect(args: argparse.Namespace) -> Any:
    """A kfp.Client for `args.endpoint`, authenticated as `resolve_token` decides."""
    import kfp
    from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

    if not args.endpoint:
        raise ConfigError("no KFP endpoint: pass --endpoint URL or set KFP_ENDPOINT")
    token = resolve_token(args.token_file)
    kwargs: dict[str, Any] = {}
    if token and token.value:
        kwargs["existing_token"] = token.value
    elif token and token.path:
        # kfp's own credentials class: re-reads the file per request, as the kubelet rotates it
        kwargs["credentials"] = ServiceAccountTokenVolumeCredentials(path=token.path)

    class _Client(kfp.Client):  # type: ignore[misc]
        def get_kfp_healthz(self, sleep_duration: int = 5) -> Any:
            """One attempt: kfp retries 5 times 5 s apart, and a 401 never heals by waiting."""
            return self._healthz_api.healthz_service_get_healthz()

    with kfp_errors(args.endpoint, "connecting"):
        return _Client(
            host=args.endpoint,
            namespace=args.namespace or "kubeflow",  # kfp's default means "not multi-user"
            ui_host=ui_base(args.endpoint, args.ui_url),
            **kwargs,
        )


def _message(err: Any) -> str:
    """The server's message from a grpc-gateway body ({message}) or an upload error body
    ({error_message}), else the HTTP reason."""
    try:
        body = json.loads(err.body)
        return str(body.get("message") or body.get("error_message") or err.body)
    except (TypeError, ValueError, AttributeError):
        return str(err.reason)


@contextlib.contextmanager
def kfp_errors(endpoint: str, doing: str) -> Iterator[None]:
    """Turn what kfp raises into one-line ConfigErrors, and keep kfp's own prints (links built
    from the API host, "Experiment details: ...") off stdout; the commands print their own."""
    import kfp_server_api
    import urllib3

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    except kfp_server_api.ApiException as err:
        hint = ""
        if err.status in (401, 403):
            hint = (
                f" (check the token: --token-file, ${TOKEN_ENV} or ${SA_TOKEN_PATH_ENV}; "
                "and --namespace on multi-user Kubeflow)"
            )
        raise ConfigError(
            f"KFP at {endpoint} refused {doing} ({err.status}): {_message(err)}{hint}"
        ) from None
    except (urllib3.exceptions.HTTPError, TimeoutError, ConnectionError) as err:
        raise ConfigError(f"cannot reach KFP at {endpoint}: {err}") from None
