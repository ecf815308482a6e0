"""The authenticated kfp.Client that `kubellm submit` and `kubellm schedule` share.

One place decides where the endpoint, the bearer token and the UI link come from, and turns
the client's exceptions into one-line `ConfigError`s, so both commands behave alike:

- endpoint: `--endpoint` or `$KFP_ENDPOINT` (the ml-pipeline API, a port-forward of it, the
  Pipelines UI, which proxies `/apis`, or a Kubeflow dashboard URL ending in `/pipeline`);
- token: `--token-file PATH`, else `$KFP_TOKEN`, else kfp's own in-cluster convention,
  `$KF_PIPELINES_SA_TOKEN_PATH` or the projected token at
  /var/run/secrets/kubeflow/pipelines/token. A token never travels as a command-line value
  (`ps` and shell history would show it) nor as a pipeline parameter. kfp.Client skips the
  in-cluster token whenever a host is given, so it is honoured here. Sent straight to
  ml-pipeline, the API server checks it with a TokenReview for the audience
  `pipelines.kubeflow.org` (its TOKEN_REVIEW_AUDIENCE default), so a ServiceAccount token
  is `kubectl create token SA --audience pipelines.kubeflow.org`;
- user: `--user EMAIL` sends it as the `kubeflow-userid` header, the identity header a
  multi-user install's API server reads (USERID_HEADER in KFP's pipeline-install-config, no
  prefix) and that Istio adds behind the Kubeflow gateway: for a port-forward straight to
  ml-pipeline, where nothing adds it. Not a secret: it is who you say you are;
- cookie: `--cookie-file PATH`, the Kubeflow gateway's session cookie after a Dex sign-in
  (`oauth2_proxy_kubeflow=...` from Kubeflow 1.9, `authservice_session=...` before), sent
  as the Cookie header as kfp's `cookies=` does. The file holds `name=value` (pairs joined by
  `; ` or on lines of their own, as the browser's Cookie header shows them); its content is
  never printed, and a file others can read draws a warning, as ssh does for a key;
- UI link: `--ui-url` or `$KF_PIPELINES_UI_ENDPOINT` (kfp's variable), else derived from the
  endpoint when that is certain, else none and a sentence saying how to get one;
- backend version: what the API server announces at `/apis/v2beta1/healthz`; an older
  backend than `MIN_BACKEND`, or one that does not say, is refused before anything is sent
  (`check_backend_version`), unless `--skip-version-check`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kubellm.config import ConfigError, PipelineConfig, parse_overrides, pipeline_config

TOKEN_ENV = "KFP_TOKEN"
# the multi-user identity header as Kubeflow's manifests configure the API server
# (USERID_HEADER "kubeflow-userid", USERID_PREFIX ""): pipeline-install-config.yaml @2.17.0
USER_HEADER = "kubeflow-userid"
TOKEN_AUDIENCE = "pipelines.kubeflow.org"  # common/const.go DefaultTokenReviewAudience
# kfp.client.KF_PIPELINES_SA_TOKEN_ENV / KF_PIPELINES_SA_TOKEN_PATH (kfp/client/__init__.py)
SA_TOKEN_PATH_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
SA_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
UI_ENV = "KF_PIPELINES_UI_ENDPOINT"  # kfp.client.client.KF_PIPELINES_UI_ENDPOINT_ENV
API_PORTS = {8888, 8887}  # ml-pipeline's HTTP and gRPC ports: the API server, which has no UI

# The oldest KFP backend the compiled pipeline runs on, and the one we test against. Why
# (README "Supported versions"): the exit handler's PipelineTaskFinalStatus input needs 2.14
# (2.5's argocompiler: "task final status not supported yet"); optional Secret/ConfigMap env
# needs 2.15 (before, every step waits in CreateContainerConfigError when the optional
# `mlflow-credentials` Secret is missing); `set_security_context` needs 2.16: the API
# server's compiler parses each executor's Kubernetes config strictly against its proto
# (argocompiler/container.go), which has no securityContext before 2.16, so 2.15 refuses
# the run; 2.17 propagates the state of nested dsl.If groups (before, the exit handler's
# group can stay "Running" after its tasks finish).
MIN_BACKEND = (2, 16)
RECOMMENDED_BACKEND = (2, 17)
HEALTHZ = "/apis/v2beta1/healthz"
_NOT_ASKED = object()  # healthz not fetched yet (kfp.Client skips it when given a namespace)
# a release tag as KFP names them: 2.17.0, 2.0.0-rc.1 (a `v` tolerated); not 1.0-dev, master
_RELEASE = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:-(?:alpha|beta|rc)\.\d+)?")


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
        f"${SA_TOKEN_PATH_ENV} or {SA_TOKEN_PATH} when present, as kfp does in-cluster); "
        f"a ServiceAccount token needs the audience {TOKEN_AUDIENCE}",
    )
    p.add_argument(
        "--user",
        default=None,
        metavar="EMAIL",
        help=f"send EMAIL as the {USER_HEADER} header: a port-forward to a multi-user "
        "install's ml-pipeline, where no gateway adds it",
    )
    p.add_argument(
        "--cookie-file",
        default=None,
        metavar="PATH",
        help="file holding the Kubeflow session cookie after a Dex sign-in, as name=value "
        "(oauth2_proxy_kubeflow=...; authservice_session=... before Kubeflow 1.9); keep it 0600",
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
    p.add_argument(
        "--skip-version-check",
        action="store_true",
        help=f"do not refuse a KFP backend older than {_dotted(MIN_BACKEND)} or one that "
        "announces no version (official images before 2.16.0 say 'unknown'; a build of "
        "your own may too): check the ml-pipeline image tag yourself first",
    )


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(n) for n in version)


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


_COOKIE_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 6265 cookie-name (token)


def read_cookie_file(path: str) -> str:
    """The Cookie header value in the file at `path` (`--cookie-file`): `name=value` pairs,
    joined by `;` or one a line; blank lines and `#` comments skipped. Anything else is one
    ConfigError that names the file and the line, never its content; a warning on stderr
    when group or others can read the file."""
    named = f"the cookie file {path} (--cookie-file)"
    try:
        text = Path(path).read_text()
        mode = Path(path).stat().st_mode
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {named}: {err}") from None
    if mode & 0o077:
        print(
            f"kubellm: warning: {named} is readable by others (mode {mode & 0o777:o}); "
            f"chmod 600 {path}",
            file=sys.stderr,
        )
    pairs: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "\t" in line:
            raise ConfigError(
                f"{named} line {number}: looks like a Netscape cookies.txt line; write the "
                "cookie as name=value (e.g. oauth2_proxy_kubeflow=...)"
            )
        for pair in (p.strip() for p in line.split(";")):
            name, eq, value = pair.partition("=")
            if not pair:
                continue
            if not eq or not _COOKIE_NAME.fullmatch(name.strip()) or not value.strip():
                raise ConfigError(
                    f"{named} line {number}: not a name=value cookie "
                    "(e.g. oauth2_proxy_kubeflow=...)"
                )
            pairs.append(f"{name.strip()}={value.strip()}")
    if not pairs:
        raise ConfigError(f"{named} holds no cookie: write name=value (oauth2_proxy_kubeflow=...)")
    return "; ".join(pairs)


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


def parse_backend_version(tag_name: Any) -> tuple[int, int, int] | None:
    """The release a healthz `tag_name` names (`2.17.0`, `v2.15.1`, `2.16.0-rc.1`), or None
    when it names none: `unknown` (the Dockerfile's default, what official images before
    2.16.0 report), `master`, `1.0-dev`, empty or missing."""
    match = _RELEASE.fullmatch(tag_name.strip()) if isinstance(tag_name, str) else None
    if not match:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def backend_version_error(endpoint: str, healthz: Any) -> str | None:
    """Why kubellm will not send to the backend whose healthz body is `healthz`, or None.

    The API server's HTTP healthz handler writes `{commit_sha, tag_name, multi_user[,
    pipeline_store]}`, `tag_name` from the image's `TAG_NAME` (backend/src/apiserver/main.go,
    backend/Dockerfile). kfp_server_api's V2beta1GetHealthzResponse drops `tag_name`, so the
    body is read raw. A server that does not say is refused too: the official images carry
    the tag from 2.16.0 on (kubeflow/pipelines#12795), so one saying `unknown` is an older
    official image (Kubeflow 1.10's 2.5.0 among them) or a build of its own, which only its
    image tag can date; `--skip-version-check` is for the latter.
    """
    need = f"kubellm needs KFP backend {_dotted(MIN_BACKEND)} or newer "
    need += f"({_dotted(RECOMMENDED_BACKEND)} recommended; README 'Supported versions')"
    tag = healthz.get("tag_name") if isinstance(healthz, dict) else None
    found = parse_backend_version(tag)
    if found is None:
        said = f"tag_name {tag!r}" if isinstance(healthz, dict) else "a body that is not JSON"
        return (
            f"KFP at {endpoint} does not announce its backend version ({HEALTHZ} answered "
            f"{said}, as official images before 2.16.0 do); {need}: check the ml-pipeline "
            "image tag (kubectl -n kubeflow get deploy ml-pipeline -o jsonpath='{..image}') "
            "and pass --skip-version-check only if it is a newer build of your own"
        )
    if found[:2] < MIN_BACKEND:
        return f"KFP at {endpoint} runs backend {tag}; {need}"
    return None


def check_backend_version(client: Any, endpoint: str) -> None:
    """Refuse, in one line naming the minimum and what was found, a backend that cannot run
    the compiled pipeline (see `MIN_BACKEND`), before a run or schedule is sent to it. Uses
    the healthz body kfp.Client fetched while connecting when it did (no namespace given)."""
    if client.healthz_body is _NOT_ASKED:
        with kfp_errors(endpoint, "connecting"):
            client.get_kfp_healthz()
    error = backend_version_error(endpoint, client.healthz_body)
    if error:
        raise ConfigError(error)


def connect(args: argparse.Namespace, *, check_version: bool = True) -> Any:
    """A kfp.Client for `args.endpoint`, authenticated as `resolve_token` decides; with
    `check_version` (what creates or enables runs), one whose backend is new enough."""
    import kfp
    import kfp_server_api
    from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

    if not args.endpoint:
        raise ConfigError("no KFP endpoint: pass --endpoint URL or set KFP_ENDPOINT")
    token = resolve_token(args.token_file)
    user = (getattr(args, "user", None) or "").strip()
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in user):
        raise ConfigError("--user: a header value cannot hold control characters")
    cookie_file = getattr(args, "cookie_file", None)
    kwargs: dict[str, Any] = {}
    if cookie_file:
        kwargs["cookies"] = read_cookie_file(cookie_file)  # kfp sends it as the Cookie header
    if token and token.value:
        kwargs["existing_token"] = token.value
    elif token and token.path:
        # kfp's own credentials class: re-reads the file per request, as the kubelet rotates it
        kwargs["credentials"] = ServiceAccountTokenVolumeCredentials(path=token.path)

    class _Client(kfp.Client):  # type: ignore[misc]
        healthz_body: Any = _NOT_ASKED

        def _load_context_setting_or_default(self) -> None:
            """kfp's one header of its own (context.json's client_authentication_header_*),
            read before the API client is built: the identity header with `--user`."""
            super()._load_context_setting_or_default()
            if user:
                self._context_setting["client_authentication_header_name"] = USER_HEADER
                self._context_setting["client_authentication_header_value"] = user

        def get_kfp_healthz(self, sleep_duration: int = 5) -> Any:
            """One attempt: kfp retries 5 times 5 s apart, and a 401 never heals by waiting.
            The body is kept raw (`healthz_body`: its `tag_name`, which the model drops)."""
            response = self._healthz_api.healthz_service_get_healthz(
                _preload_content=False, _request_timeout=30
            )
            try:
                self.healthz_body = json.loads(response.data)
            except (TypeError, ValueError):
                self.healthz_body = None
            body = self.healthz_body if isinstance(self.healthz_body, dict) else {}
            return kfp_server_api.V2beta1GetHealthzResponse(
                multi_user=body.get("multi_user"), pipeline_store=body.get("pipeline_store")
            )

    with kfp_errors(args.endpoint, "connecting"):
        client = _Client(
            host=args.endpoint,
            namespace=args.namespace or "kubeflow",  # kfp's default means "not multi-user"
            ui_host=ui_base(args.endpoint, args.ui_url),
            **kwargs,
        )
    if check_version and not getattr(args, "skip_version_check", False):
        check_backend_version(client, args.endpoint)
    return client


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
                f" (check the token: --token-file, ${TOKEN_ENV} or ${SA_TOKEN_PATH_ENV}, "
                f"audience {TOKEN_AUDIENCE}; or --cookie-file, or --user for a port-forward; "
                "and --namespace on multi-user Kubeflow)"
            )
        raise ConfigError(
            f"KFP at {endpoint} refused {doing} ({err.status}): {_message(err)}{hint}"
        ) from None
    except (urllib3.exceptions.HTTPError, TimeoutError, ConnectionError) as err:
        raise ConfigError(f"cannot reach KFP at {endpoint}: {err}") from None
