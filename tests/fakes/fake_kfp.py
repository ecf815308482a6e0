"""A FAKE Kubeflow Pipelines API server, for what cannot run here (a cluster with KFP).

It serves the slice of the v2beta1 REST API that `kfp.Client` (and the `kfp` CLI) walk
through for runs, uploaded pipelines and recurring runs:

- `GET /apis/v2beta1/healthz` and `/apis/v1beta1/healthz`: the API server's own HTTP handler
  (registered on the top mux ahead of the grpc-gateway, so the proto's GetHealthzResponse is
  not what answers), `{"commit_sha", "tag_name", "multi_user"}` plus `"pipeline_store"` on
  v2beta1 from 2.14 on (kubeflow/pipelines backend/src/apiserver/main.go#L271-L282 @2.5.0,
  #L465-L512 @2.17.0). `tag_name` is the image's TAG_NAME, default `unknown`
  (backend/Dockerfile#L65-L66 @2.17.0); the release images are built with it only from
  2.16.0 on (.github/workflows/build-and-push.yml, kubeflow/pipelines#12795; 2.4.0 answered
  `unknown`: kubeflow/pipelines#11573). `FakeKfp(tag_name=...)` says which, default 2.17.0;
- experiments: `GET /experiments?filter=...`, `POST /experiments`, `GET /experiments/{id}`;
- runs: `POST /runs` (the compiled pipeline inline, or a pipeline_version_reference),
  `GET /runs/{id}`;
- pipelines: `POST /pipelines` (the pipeline alone), `POST /pipelines/upload` and
  `POST /pipelines/upload_version` (multipart `uploadfile`, names in the query string),
  `GET /pipelines[?filter,namespace]`, `GET /pipelines/{id}`, `GET /pipelines/{id}/versions`,
  `GET /pipelines/{id}/versions/{version_id}`;
- recurring runs: `POST /recurringruns`, `GET /recurringruns[?experiment_id,filter]`,
  `GET|DELETE /recurringruns/{id}`, `POST /recurringruns/{id}:enable|:disable`.

Responses have the server's JSON shapes (snake_case fields, RFC 3339 times, int64 as strings,
a new run in state PENDING, errors as grpc-gateway `{error, code, message, details}` bodies;
the upload handlers' own `{error_message, error_details}`), and its status codes: 400 invalid,
404 missing, 409 a pipeline (per namespace) or version (per pipeline) name taken, as the
database's unique indexes make it; with `token=`, 401 for a request without
`Authorization: Bearer <token>`, as behind Kubeflow's auth proxy.

Sign-in (each request's headers are recorded, `Recorded.header(name)`):

- `user=` (multi-user mode): every request but healthz needs an identity, as the API server's
  IsAuthorized does: the `kubeflow-userid` header (USERID_HEADER as Kubeflow's manifests set
  it, prefix "") or, with `token=`, the bearer token (TokenReview); none is 401, two of the
  header 400, any other user than `user` 403 (SubjectAccessReview denied);
- `session_cookie="name=value"`: the Kubeflow gateway in front (Istio and oauth2-proxy): a
  request with neither the cookie nor a bearer token is 401 (oauth2-proxy's api_routes), one
  with the cookie reaches the API server with `kubeflow-userid: <user>` put in by the gateway,
  whatever the client sent.

No pipeline runs. What makes it worth having is that every body is checked the way the real
API server checks it:

- a body has only fields of its kfp_server_api model (V2beta1Run, V2beta1RecurringRun,
  V2beta1Pipeline, and nested RuntimeConfig, Trigger, CronSchedule, PipelineVersionReference)
  and a display_name; a run goes to the experiment it names (404 when there is none) or,
  without one, to the default experiment `Default` (created when missing; multi-user mode:
  400), as GetValidExperimentNamespacePair does;
- pipeline_spec (inline, bare, or `{pipeline_spec, platform_spec}` as the client sends a spec
  with a platform part; or the uploaded YAML) parses as the PipelineSpec (and PlatformSpec)
  protobuf of kfp-pipeline-spec, has pipelineInfo.name, root.dag and deploymentSpec, and
  every executorLabel and componentRef it names exists;
- a pipeline_version_reference names a pipeline and a version of it that exist;
- each Kubernetes executor config of the platform spec parses strictly as a
  KubernetesExecutorConfig, as the API server's argocompiler does when it compiles a run or
  recurring run (`protojson.Unmarshal`, unknown fields refused: backend/src/v2/compiler/
  argocompiler/container.go#L307-L309 @2.15.0), else 500 "failed to unmarshal kubernetes
  config"; checked against the installed kfp-kubernetes proto (2.17), less
  `securityContext` when the announced release is older than 2.16, whose proto lacks it
  (kubernetes_platform/proto/kubernetes_executor_config.proto#L43 @2.16.0);
- every runtime_config parameter is a declared root input parameter of that spec and its
  JSON value fits the declared parameterType (NUMBER_INTEGER: an integral number,
  NUMBER_DOUBLE: a number, STRING, BOOLEAN, LIST, STRUCT; a bool is never a number), and no
  required root parameter (no default, not optional) is left out;
- a recurring run's mode is a RecurringRun.Mode (ENABLE enables it; DISABLE,
  MODE_UNSPECIFIED or none disable it), max_concurrency is 1 to 10, and one trigger: a
  cron_schedule whose cron robfig/cron v1.2.0's `cron.Parse` accepts (the parser KFP's
  server and ScheduledWorkflow controller use: 5-6 fields, seconds first) or a
  periodic_schedule of at least 1 s.

Anything else gets the real server's error status naming the field and is recorded in
`errors` so a test can assert there were none. Like the server's protobuf Value, JSON does
not tell 0 from 0.0 apart for the check; the recorded bodies keep the exact JSON so a test
can assert the type the client sent.

    with FakeKfp() as fake:
        kfp.Client(host=fake.url).create_run_from_pipeline_package("p.yaml", {"x": 1})
        assert fake.errors == []
        assert fake.created_runs()[0]["runtime_config"]["parameters"] == {"x": 1}
"""

from __future__ import annotations

import copy
import email.parser
import email.policy
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlsplit

import kfp_server_api
import yaml
from google.protobuf import json_format
from kfp.kubernetes import kubernetes_executor_config_pb2
from kfp.pipeline_spec import pipeline_spec_pb2

from kubellm.commands.schedule import robfig_cron_error

from .http_fake import JsonHandler, LoopbackFake

API = "/apis/v2beta1"

# grpc status codes the gateway puts in error bodies
_INVALID_ARGUMENT, _NOT_FOUND, _ALREADY_EXISTS, _UNIMPLEMENTED, _UNAUTHENTICATED = 3, 5, 6, 12, 16
_INTERNAL, _PERMISSION_DENIED = 13, 7
# the identity header Kubeflow's manifests give the API server (USERID_HEADER, with
# USERID_PREFIX "", in pipeline-install-config); the server's own default is Google IAP's
USER_HEADER = "kubeflow-userid"
_HTTP = {
    _PERMISSION_DENIED: 403,
    _INTERNAL: 500,
    _INVALID_ARGUMENT: 400,
    _NOT_FOUND: 404,
    _ALREADY_EXISTS: 409,
    _UNIMPLEMENTED: 501,
    _UNAUTHENTICATED: 401,
}

# the fields the server's protobuf messages have (the generated client's models mirror them)
RUN_FIELDS = frozenset(kfp_server_api.V2beta1Run.attribute_map.values())
RUNTIME_CONFIG_FIELDS = frozenset(kfp_server_api.V2beta1RuntimeConfig.attribute_map.values())
EXPERIMENT_FIELDS = frozenset(kfp_server_api.V2beta1Experiment.attribute_map.values())
PIPELINE_FIELDS = frozenset(kfp_server_api.V2beta1Pipeline.attribute_map.values())
RECURRING_RUN_FIELDS = frozenset(kfp_server_api.V2beta1RecurringRun.attribute_map.values())
TRIGGER_FIELDS = frozenset(kfp_server_api.V2beta1Trigger.attribute_map.values())
CRON_FIELDS = frozenset(kfp_server_api.V2beta1CronSchedule.attribute_map.values())
PERIODIC_FIELDS = frozenset(kfp_server_api.V2beta1PeriodicSchedule.attribute_map.values())
VERSION_REF_FIELDS = frozenset(
    kfp_server_api.V2beta1PipelineVersionReference.attribute_map.values()
)
# RecurringRun.Mode (backend/api/v2beta1/recurring_run.proto): protojson reads the name or
# the number; toModelJobEnabled enables ENABLE only (MODE_UNSPECIFIED, or no mode: disabled).
RECURRING_RUN_MODES = {
    name: number
    for number, name in enumerate(("MODE_UNSPECIFIED", "ENABLE", "DISABLE"))
    if name in kfp_server_api.RecurringRunMode.allowable_values
}

# list responses' JSON keys as the models read them (the proto names: `recurringRuns`)
_LIST_KEY = {
    "pipelines": kfp_server_api.V2beta1ListPipelinesResponse.attribute_map["pipelines"],
    "pipeline_versions": kfp_server_api.V2beta1ListPipelineVersionsResponse.attribute_map[
        "pipeline_versions"
    ],
    "recurring_runs": kfp_server_api.V2beta1ListRecurringRunsResponse.attribute_map[
        "recurring_runs"
    ],
}

_EXPERIMENT = re.compile(rf"^{API}/experiments/(?P<id>[^/:]+)$")
_RUN = re.compile(rf"^{API}/runs/(?P<id>[^/:]+)$")
_PIPELINE = re.compile(rf"^{API}/pipelines/(?P<id>[^/:]+)$")
_VERSIONS = re.compile(rf"^{API}/pipelines/(?P<id>[^/:]+)/versions$")
_VERSION = re.compile(rf"^{API}/pipelines/(?P<id>[^/:]+)/versions/(?P<vid>[^/:]+)$")
_RECURRING = re.compile(rf"^{API}/recurringruns/(?P<id>[^/:]+?)(?P<verb>:enable|:disable)?$")


@dataclass(frozen=True)
class Recorded:
    """One request as the fake received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    headers: tuple[tuple[str, str], ...] = field(default=())

    def header(self, name: str) -> list[str]:
        """Every value of header `name` (any case) the request carried, in order."""
        return [v for k, v in self.headers if k.lower() == name.lower()]


class _Reply(Exception):
    """Ends a request with a grpc-gateway error body (or, from the upload handlers, which
    are plain HTTP handlers, the v1beta1 Error body they write)."""

    def __init__(self, grpc_code: int, message: str, *, upload: bool = False) -> None:
        super().__init__(message)
        self.code = _HTTP[grpc_code]
        self.body: dict[str, Any] = (
            {"error_message": message, "error_details": message}
            if upload
            else {"error": message, "code": grpc_code, "message": message, "details": []}
        )


KFP_CLIENT_ENV = (
    "KFP_ENDPOINT",
    "KFP_TOKEN",
    "KF_PIPELINES_SA_TOKEN_PATH",
    "KF_PIPELINES_ENDPOINT",
    "KF_PIPELINES_UI_ENDPOINT",
    "KF_PIPELINES_DEFAULT_EXPERIMENT_NAME",
    "KF_PIPELINES_OVERRIDE_EXPERIMENT_NAME",
)


def isolate_kfp_client(monkeypatch: Any, tmp_path: Any) -> None:
    """No endpoint, token, experiment or namespace from this machine's environment, from
    ~/.config/kfp/context.json or from an in-cluster token file: only what a test passes."""
    for var in KFP_CLIENT_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(
        "kfp.client.client.Client._LOCAL_KFP_CONTEXT", str(tmp_path / "kfp" / "context.json")
    )
    monkeypatch.setattr("kubellm.kfp.client.SA_TOKEN_PATH", str(tmp_path / "no-sa-token"))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_PARAMETER_TYPES: dict[str, tuple[str, Any]] = {
    "NUMBER_INTEGER": (
        "an integer",
        lambda v: _is_number(v) and float(v).is_integer(),
    ),
    "NUMBER_DOUBLE": ("a number", _is_number),
    "STRING": ("a string", lambda v: isinstance(v, str)),
    "BOOLEAN": ("a boolean", lambda v: isinstance(v, bool)),
    "LIST": ("a list", lambda v: isinstance(v, list)),
    "STRUCT": ("an object", lambda v: isinstance(v, dict)),
}


def pipeline_spec_errors(spec: Any) -> list[str]:
    """Errors of an inline pipeline_spec (empty when it is a valid compiled pipeline)."""
    if not isinstance(spec, dict):
        return ["pipeline_spec: must be an object"]
    if "pipeline_spec" in spec:  # the client wraps a spec that has a platform part
        unknown = set(spec) - {"pipeline_spec", "platform_spec"}
        if unknown:
            return [f"pipeline_spec: unknown fields {sorted(unknown)}"]
        try:
            json_format.ParseDict(spec.get("platform_spec") or {}, pipeline_spec_pb2.PlatformSpec())
        except json_format.ParseError as err:
            return [f"pipeline_spec.platform_spec: not a PlatformSpec: {err}"]
        spec = spec["pipeline_spec"]
        if not isinstance(spec, dict):
            return ["pipeline_spec.pipeline_spec: must be an object"]
    try:
        json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())
    except json_format.ParseError as err:
        return [f"pipeline_spec: not a PipelineSpec: {err}"]
    errors = []
    if not (spec.get("pipelineInfo") or {}).get("name"):
        errors.append("pipeline_spec.pipelineInfo.name: required")
    if not (spec.get("root") or {}).get("dag"):
        errors.append("pipeline_spec.root.dag: required")
    executors = (spec.get("deploymentSpec") or {}).get("executors")
    if not executors:
        errors.append("pipeline_spec.deploymentSpec.executors: required")
        executors = {}
    components = spec.get("components") or {}
    for name, comp in components.items():
        label = comp.get("executorLabel")
        if label and label not in executors:
            errors.append(
                f"pipeline_spec.components.{name}: executor {label} not in deploymentSpec"
            )
    dags = [("root", spec.get("root") or {})]
    dags += [(f"components.{n}", c) for n, c in components.items()]
    for where, comp in dags:
        for task, body in ((comp.get("dag") or {}).get("tasks") or {}).items():
            ref = (body.get("componentRef") or {}).get("name")
            if ref not in components:
                errors.append(f"pipeline_spec.{where}.dag.tasks.{task}: no component {ref!r}")
    return errors


def root_parameters(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pipeline's declared input parameters, by name."""
    spec = spec.get("pipeline_spec", spec)
    return ((spec.get("root") or {}).get("inputDefinitions") or {}).get("parameters") or {}


def runtime_parameter_errors(spec: dict[str, Any], parameters: Any) -> list[str]:
    """Errors of runtime_config.parameters against the spec's root input definitions."""
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        return ["runtime_config.parameters: must be an object"]
    declared = root_parameters(spec)
    errors = []
    for name, value in parameters.items():
        where = f"runtime_config.parameters.{name}"
        if name not in declared:
            errors.append(
                f"{where}: not an input parameter of the pipeline "
                f"(declared: {', '.join(sorted(declared)) or 'none'})"
            )
            continue
        ptype = declared[name].get("parameterType", "")
        want, fits = _PARAMETER_TYPES.get(ptype, (f"of unknown type {ptype}", lambda v: False))
        if not fits(value):
            errors.append(f"{where}: {ptype} needs {want}, got {value!r}")
    for name, decl in declared.items():
        required = not decl.get("isOptional") and "defaultValue" not in decl
        if required and name not in parameters:
            errors.append(f"runtime_config.parameters.{name}: required (no default)")
    return errors


def unknown_fields(body: dict[str, Any], allowed: frozenset[str], where: str = "") -> list[str]:
    """`where.field: unknown field` for each key the server's message does not have."""
    return [f"{where}{k}: unknown field" for k in sorted(set(body) - allowed)]


def spec_from_yaml(text: str) -> tuple[dict[str, Any] | None, list[str]]:
    """An uploaded pipeline YAML as the client would inline it, and its errors."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        return None, [f"uploadfile: not YAML: {err}"]
    if not docs or not all(isinstance(d, dict) for d in docs):
        return None, ["uploadfile: not a compiled pipeline"]
    platform: dict[str, Any] = {}
    for doc in docs[1:]:
        platform.update(doc)
    spec = {"pipeline_spec": docs[0], "platform_spec": platform}
    return spec, pipeline_spec_errors(spec)


def _int64(value: Any) -> int | None:
    """An int64 field as protojson reads it: a JSON number or a decimal string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value):
        return int(value)
    return None


class FakeKfp(LoopbackFake):
    """The fake KFP API server; a context manager that serves on 127.0.0.1 on a free port."""

    def __init__(
        self,
        *,
        multi_user: bool = False,
        token: str | None = None,
        tag_name: str = "2.17.0",
        commit_sha: str = "unknown",
        user: str | None = None,
        session_cookie: str | None = None,
    ) -> None:
        super().__init__()
        # multi-user authz: the one user with access to every namespace (needs multi_user)
        self.user = user
        # the gateway's session cookie `name=value` (oauth2_proxy_kubeflow=...): a request
        # without it (or a bearer token) is refused before the API server
        self.session_cookie = session_cookie
        if (user is not None or session_cookie is not None) and not multi_user:
            raise ValueError("user= and session_cookie= model a multi-user install")
        if session_cookie is not None and user is None:
            raise ValueError("session_cookie= needs the user= the session signs in")
        self.multi_user = multi_user
        # what healthz announces: the release (`2.5.0`), or `unknown` as official images
        # before 2.16.0 answer (built without the TAG_NAME build-arg)
        self.tag_name = tag_name
        self.commit_sha = commit_sha
        self.token = token  # when set, every request needs `Authorization: Bearer <token>`
        self._lock = threading.RLock()
        self.experiments: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.pipelines: dict[str, dict[str, Any]] = {}
        self.versions: dict[str, dict[str, Any]] = {}  # by pipeline_version_id
        self.recurring_runs: dict[str, dict[str, Any]] = {}
        self.requests: list[Recorded] = []
        self.errors: list[str] = []  # every rejected request's reasons, across requests

    # ------------------------------------------------------------ test controls

    def add_experiment(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        """An experiment that exists before the code under test runs."""
        with self._lock:
            return copy.deepcopy(self._store_experiment(name, namespace, None))

    def created_runs(self) -> list[Any]:
        """Bodies POSTed to /runs, as sent (accepted or not)."""
        return [r.body for r in self.requests if r.method == "POST" and r.path == f"{API}/runs"]

    def created_recurring_runs(self) -> list[Any]:
        """Bodies POSTed to /recurringruns, as sent (accepted or not)."""
        path = f"{API}/recurringruns"
        return [r.body for r in self.requests if r.method == "POST" and r.path == path]

    # ------------------------------------------------------------ request handling

    def handle(
        self,
        method: str,
        raw_path: str,
        body: Any,
        authorization: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> tuple[int, Any]:
        parts = urlsplit(raw_path)
        query = parse_qs(parts.query)
        path = parts.path.rstrip("/")
        with self._lock:
            self.requests.append(Recorded(method, path, query, copy.deepcopy(body), headers))
            try:
                if self.token is not None and authorization != f"Bearer {self.token}":
                    self.errors.append(f"{method} {path}: no valid bearer token")
                    raise _Reply(
                        _UNAUTHENTICATED,
                        "Request header error: there is no user identity header.",
                    )
                headers = self._gateway(method, path, headers, authorization)
                if self.user is not None and not path.endswith("/healthz"):
                    self._authorize(method, path, headers, authorization)
                return 200, self._route(method, path, query, body)
            except _Reply as reply:
                return reply.code, reply.body
            except Exception as err:  # a body shape the checks did not foresee: still answer
                self.errors.append(f"{method} {path}: the fake failed: {err!r}")
                return 500, {"error": repr(err), "code": 13, "message": repr(err), "details": []}

    def _gateway(
        self,
        method: str,
        path: str,
        headers: tuple[tuple[str, str], ...],
        authorization: str | None,
    ) -> tuple[tuple[str, str], ...]:
        """Istio and oauth2-proxy in front of the API server, when `session_cookie` is set:
        the request's headers as they reach the API server."""
        if self.session_cookie is None:
            return headers
        sent = [c.strip() for k, v in headers if k.lower() == "cookie" for c in v.split(";")]
        if self.session_cookie in sent:  # oauth2-proxy's JWT, unpacked by Istio
            kept = tuple((k, v) for k, v in headers if k.lower() != USER_HEADER)
            return (*kept, (USER_HEADER, str(self.user)))
        if (authorization or "").startswith("Bearer "):  # straight on to Istio
            return headers
        self.errors.append(f"{method} {path}: no session cookie")
        raise _Reply(_UNAUTHENTICATED, "Unauthorized")

    def _authorize(
        self,
        method: str,
        path: str,
        headers: tuple[tuple[str, str], ...],
        authorization: str | None,
    ) -> None:
        """The API server's IsAuthorized in multi-user mode: the identity from the user
        header, else from a bearer token (a TokenReview), then a SubjectAccessReview."""
        values = [v for k, v in headers if k.lower() == USER_HEADER]
        if len(values) > 1:
            message = (
                f"Request header error: unexpected number of '{USER_HEADER}' headers. "
                f"Expect 1 got {len(values)}"
            )
            self.errors.append(f"{method} {path}: {message}")
            raise _Reply(_INVALID_ARGUMENT, message)
        if values:
            identity = values[0]  # USERID_PREFIX "": nothing to strip
        elif self.token is not None and authorization == f"Bearer {self.token}":
            identity = str(self.user)  # the TokenReview's user for the token
        else:
            self.errors.append(f"{method} {path}: no user identity")
            raise _Reply(
                _UNAUTHENTICATED,
                "Failed to check authorization. User identity is empty in the request header: "
                "Request header error: there is no user identity header.",
            )
        if identity != self.user:
            message = f"User '{identity}' is not authorized with reason:  (request: {path})"
            self.errors.append(f"{method} {path}: {message}")
            raise _Reply(_PERMISSION_DENIED, message)

    def _route(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> Any:
        if method == "GET" and path in (f"{API}/healthz", "/apis/v1beta1/healthz"):
            return self._healthz(v2=path.startswith(API))
        if path == f"{API}/experiments":
            if method == "GET":
                return self._list_experiments(query)
            if method == "POST":
                return self._create_experiment(body)
        if (m := _EXPERIMENT.match(path)) and method == "GET":
            return copy.deepcopy(self._get(self.experiments, "Experiment", m["id"]))
        if path == f"{API}/runs" and method == "POST":
            return self._create_run(body)
        if (m := _RUN.match(path)) and method == "GET":
            return copy.deepcopy(self._get(self.runs, "Run", m["id"]))
        if path.startswith(f"{API}/pipelines"):
            return self._route_pipelines(method, path, query, body)
        if path == f"{API}/recurringruns":
            if method == "POST":
                return self._create_recurring_run(body)
            if method == "GET":
                return self._list_recurring_runs(query)
        if m := _RECURRING.match(path):
            return self._recurring_run_call(method, m["id"], m["verb"])
        raise _Reply(_UNIMPLEMENTED, f"the fake KFP server does not serve {method} {path}")

    def _healthz(self, *, v2: bool) -> dict[str, Any]:
        """The HTTP healthz body as main.go writes it at the announced release: the version
        fields the proto (and so kfp_server_api's model) lacks; `pipeline_store` only on
        v2beta1 and from 2.14 on (2.5.0 writes three fields; 2.17.0's v1beta1 omits it)."""
        body: dict[str, Any] = {
            "commit_sha": self.commit_sha,
            "tag_name": self.tag_name,
            "multi_user": self.multi_user,
        }
        release = re.match(r"v?(\d+)\.(\d+)", self.tag_name)
        if v2 and (release is None or (int(release[1]), int(release[2])) >= (2, 14)):
            body["pipeline_store"] = "database"
        return body

    def _route_pipelines(
        self, method: str, path: str, query: dict[str, list[str]], body: Any
    ) -> Any:
        if path == f"{API}/pipelines/upload" and method == "POST":
            return self._upload_pipeline(query, body)
        if path == f"{API}/pipelines/upload_version" and method == "POST":
            return self._upload_version(query, body)
        if path == f"{API}/pipelines":
            if method == "POST":
                return self._create_pipeline(body)
            if method == "GET":
                return self._list_pipelines(query)
        if (m := _PIPELINE.match(path)) and method == "GET":
            return copy.deepcopy(self._get(self.pipelines, "Pipeline", m["id"]))
        if (m := _VERSIONS.match(path)) and method == "GET":
            self._get(self.pipelines, "Pipeline", m["id"])
            items = [v for v in self.versions.values() if v["pipeline_id"] == m["id"]]
            return self._page(
                self._filtered(items, query, "list pipeline versions"), query, "pipeline_versions"
            )
        if (m := _VERSION.match(path)) and method == "GET":
            version = self._get(self.versions, "PipelineVersion", m["vid"])
            if version["pipeline_id"] != m["id"]:
                raise _Reply(_NOT_FOUND, f"PipelineVersion {m['vid']} not found")
            return copy.deepcopy(version)
        raise _Reply(_UNIMPLEMENTED, f"the fake KFP server does not serve {method} {path}")

    def _reject(self, what: str, errors: list[str], *, upload: bool = False) -> NoReturn:
        self.errors += [f"{what}: {e}" for e in errors]
        raise _Reply(
            _INVALID_ARGUMENT, f"Invalid input error: {what}: " + "; ".join(errors), upload=upload
        )

    def _get(self, store: dict[str, dict[str, Any]], kind: str, key: str) -> dict[str, Any]:
        if key not in store:
            raise _Reply(_NOT_FOUND, f"{kind} {key} not found")
        return store[key]

    def _filtered(
        self, items: list[dict[str, Any]], query: dict[str, list[str]], what: str
    ) -> list[dict[str, Any]]:
        """Items that pass the query's `filter` (a JSON v2beta1 Filter; EQUALS predicates)."""
        raw_filter = (query.get("filter") or [""])[0]
        if not raw_filter:
            return items
        try:
            predicates = json.loads(raw_filter).get("predicates") or []
        except (ValueError, AttributeError):
            self._reject(what, [f"filter: not a JSON filter: {raw_filter}"])
        for pred in predicates:
            if pred.get("operation") not in (1, "EQUALS"):
                self._reject(what, [f"filter: unsupported predicate {pred}"])
            key, want = pred.get("key"), pred.get("stringValue", pred.get("string_value"))
            items = [e for e in items if e.get(key) == want]
        return items

    def _page(self, items: list[dict[str, Any]], query: dict[str, list[str]], field: str) -> Any:
        """One page of a list response (`page_size`, `page_token` = the offset)."""
        size = int((query.get("page_size") or ["0"])[0] or 0) or len(items) or 1
        start = int((query.get("page_token") or ["0"])[0] or 0)
        page = items[start : start + size]
        if not page:
            return {}  # the gateway leaves out empty fields
        out: dict[str, Any] = {_LIST_KEY[field]: copy.deepcopy(page), "total_size": len(items)}
        if start + size < len(items):
            out["next_page_token"] = str(start + size)
        return out

    # -- experiments

    def _list_experiments(self, query: dict[str, list[str]]) -> dict[str, Any]:
        namespace = (query.get("namespace") or [""])[0]
        if self.multi_user and not namespace:
            self._reject("list experiments", ["namespace: required in multi-user mode"])
        items = [e for e in self.experiments.values() if e.get("namespace", "") == namespace]
        items = self._filtered(items, query, "list experiments")
        if not items:
            return {}  # the gateway leaves out empty fields
        return {"experiments": copy.deepcopy(items), "total_size": len(items)}

    def _create_experiment(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            self._reject("create experiment", ["the body is not a JSON object"])
        errors = unknown_fields(body, EXPERIMENT_FIELDS)
        name = body.get("display_name")
        if not isinstance(name, str) or not name.strip():
            errors.append("display_name: required")
        namespace = body.get("namespace") or ""
        if self.multi_user and not namespace:
            errors.append("namespace: required in multi-user mode")
        if errors:
            self._reject("create experiment", errors)
        for e in self.experiments.values():
            if e["display_name"] == name and e.get("namespace", "") == namespace:
                raise _Reply(  # experiment_store.go CreateExperiment: NewAlreadyExistError
                    _ALREADY_EXISTS,
                    f"Failed to create a new experiment. The name {name} already exists. "
                    "Please specify a new name",
                )
        description = body.get("description")
        return copy.deepcopy(self._store_experiment(str(name), namespace, description))

    def _store_experiment(
        self, name: str, namespace: str | None, description: str | None
    ) -> dict[str, Any]:
        exp: dict[str, Any] = {
            "experiment_id": str(uuid.uuid4()),
            "display_name": name,
            "created_at": _now(),
            "storage_state": "AVAILABLE",
            "last_run_created_at": "1970-01-01T00:00:00Z",
        }
        if description:
            exp["description"] = description
        if namespace:
            exp["namespace"] = namespace
        self.experiments[exp["experiment_id"]] = exp
        return exp

    def _experiment_of(self, what: str, body: dict[str, Any], errors: list[str]) -> str:
        """The experiment a run or recurring run goes to (resource_manager.go
        GetValidExperimentNamespacePair): the one named, 404 when there is none; without one,
        400 in multi-user mode, else the default experiment (`Default`, created if missing).
        Checked after the body's other errors (`errors`), which are answered first."""
        exp_id = body.get("experiment_id")
        if not exp_id and self.multi_user:
            errors.append("experiment_id: Experiment id can not be empty in multi-user mode")
            return ""
        if not exp_id:
            namespace = body.get("namespace") or ""
            for existing in self.experiments.values():
                if existing["display_name"] == "Default" and existing.get("namespace", "") == (
                    namespace
                ):
                    return str(existing["experiment_id"])
            default = self._store_experiment(
                "Default",
                namespace,
                "All runs created without specifying an experiment will be grouped here.",
            )
            return str(default["experiment_id"])
        if not isinstance(exp_id, str) or exp_id not in self.experiments:
            if errors:
                self._reject(f"create {what}", errors)
            missing = (
                f"Failed to create a {what} due to invalid experimentId and namespace "
                f"combination: Failed to fetch namespace for experiment {exp_id}: Experiment "
                f"{exp_id} not found"
            )
            self.errors.append(missing)
            raise _Reply(_NOT_FOUND, missing)
        return exp_id

    # -- runs

    def _create_run(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            self._reject("create run", ["the body is not a JSON object"])
        errors = unknown_fields(body, RUN_FIELDS)
        name = body.get("display_name")
        if not isinstance(name, str) or not name.strip():
            errors.append("display_name: required")
        exp_id = self._experiment_of("run", body, errors)
        errors += self._spec_and_parameters(body)
        if errors:
            self._reject("create run", errors)
        now = _now()
        run = copy.deepcopy(body)
        run.update(
            run_id=str(uuid.uuid4()),
            storage_state="AVAILABLE",
            created_at=now,
            scheduled_at=now,
            finished_at="1970-01-01T00:00:00Z",
            state="PENDING",
            state_history=[{"update_time": now, "state": "PENDING"}],
        )
        run["experiment_id"] = exp_id
        self.runs[run["run_id"]] = run
        self.experiments[exp_id]["last_run_created_at"] = now
        return copy.deepcopy(run)

    def _spec_and_parameters(self, body: dict[str, Any]) -> list[str]:
        """Errors of a run's or recurring run's pipeline (inline spec or a reference to an
        uploaded version) and of its runtime_config against that pipeline."""
        errors: list[str] = []
        spec = body.get("pipeline_spec")
        ref = body.get("pipeline_version_reference")
        spec_errors: list[str] = []
        if ref and spec is not None:
            errors.append("pipeline_spec: give pipeline_spec or pipeline_version_reference")
        elif ref:
            if not isinstance(ref, dict):
                return ["pipeline_version_reference: must be an object"]
            errors += unknown_fields(ref, VERSION_REF_FIELDS, "pipeline_version_reference.")
            version = self.versions.get(str(ref.get("pipeline_version_id")))
            if version is None or version["pipeline_id"] != ref.get("pipeline_id"):
                # the server fetches the version first: NotFound, 404
                missing = (
                    f"pipeline_version_reference: version {ref.get('pipeline_version_id')} of "
                    f"pipeline {ref.get('pipeline_id')} not found"
                )
                self.errors.append(missing)
                raise _Reply(_NOT_FOUND, missing)
            spec = version["pipeline_spec"]
        elif spec is None:
            errors.append("pipeline_spec: required (or pipeline_version_reference)")
        else:
            spec_errors = pipeline_spec_errors(spec)
            errors += spec_errors
        if isinstance(spec, dict) and not spec_errors and not errors:
            self._compile_kubernetes_config(spec)
        runtime = body.get("runtime_config") or {}
        if not isinstance(runtime, dict):
            errors.append("runtime_config: must be an object")
        else:
            errors += unknown_fields(runtime, RUNTIME_CONFIG_FIELDS, "runtime_config.")
            if isinstance(spec, dict) and not spec_errors:
                errors += runtime_parameter_errors(spec, runtime.get("parameters"))
        return errors

    def _compile_kubernetes_config(self, spec: dict[str, Any]) -> None:
        """The argocompiler's strict parse of each executor's Kubernetes config: an unknown
        field fails the whole compile, so the run is refused (an internal error, 500)."""
        platform = spec.get("platform_spec") if "pipeline_spec" in spec else None
        kubernetes = ((platform or {}).get("platforms") or {}).get("kubernetes") or {}
        executors = (kubernetes.get("deploymentSpec") or {}).get("executors") or {}
        release = re.match(r"v?(\d+)\.(\d+)", self.tag_name)
        before_2_16 = release is not None and (int(release[1]), int(release[2])) < (2, 16)
        for name, config in executors.items():
            try:
                if before_2_16 and isinstance(config, dict) and "securityContext" in config:
                    raise json_format.ParseError('unknown field "securityContext"')
                json_format.ParseDict(
                    config, kubernetes_executor_config_pb2.KubernetesExecutorConfig()
                )
            except json_format.ParseError as err:
                message = (
                    "Internal error: Failed to generate the ExecutionSpec: Failed to compile "
                    f"job: failed to unmarshal kubernetes config: {name}: {err}"
                )
                self.errors.append(message)
                raise _Reply(_INTERNAL, message) from None

    # -- pipelines and versions

    def _store_pipeline(self, name: str, display: str, namespace: str, description: str) -> Any:
        if not name.strip():
            self._reject("create pipeline", ["name: required"])
        for p in self.pipelines.values():
            if p["name"] == name and p.get("namespace", "") == namespace:
                raise _Reply(_ALREADY_EXISTS, f"Pipeline with name {name} already exists")
        pipeline: dict[str, Any] = {
            "pipeline_id": str(uuid.uuid4()),
            "name": name,
            "display_name": display or name,
            "created_at": _now(),
        }
        if description:
            pipeline["description"] = description
        if namespace:
            pipeline["namespace"] = namespace
        self.pipelines[pipeline["pipeline_id"]] = pipeline
        return pipeline

    def _store_version(
        self, pipeline_id: str, name: str, display: str, spec: dict[str, Any], description: str
    ) -> dict[str, Any]:
        for v in self.versions.values():
            if v["pipeline_id"] == pipeline_id and v["name"] == name:
                raise _Reply(_ALREADY_EXISTS, "Failed to create a pipeline version", upload=True)
        version: dict[str, Any] = {
            "pipeline_id": pipeline_id,
            "pipeline_version_id": str(uuid.uuid4()),
            "name": name,
            "display_name": display or name,
            "created_at": _now(),
            "pipeline_spec": spec,
        }
        if description:
            version["description"] = description
        self.versions[version["pipeline_version_id"]] = version
        return version

    def _create_pipeline(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            self._reject("create pipeline", ["the body is not a JSON object"])
        errors = unknown_fields(body, PIPELINE_FIELDS)
        namespace = body.get("namespace") or ""
        if errors:
            self._reject("create pipeline", errors)
        name = str(body.get("name") or body.get("display_name") or "")
        pipeline = self._store_pipeline(
            name, str(body.get("display_name") or ""), namespace, body.get("description") or ""
        )
        return copy.deepcopy(pipeline)

    def _list_pipelines(self, query: dict[str, list[str]]) -> Any:
        namespace = (query.get("namespace") or [""])[0]
        items = [p for p in self.pipelines.values() if p.get("namespace", "") == namespace]
        return self._page(self._filtered(items, query, "list pipelines"), query, "pipelines")

    def _uploaded(self, what: str, body: Any) -> tuple[str, dict[str, Any]]:
        """(file name, pipeline spec) of a multipart `uploadfile`, or a 400 upload error."""
        upload = (body or {}).get("uploadfile") if isinstance(body, dict) else None
        if not upload:
            self._reject(what, ["uploadfile: no multipart file"], upload=True)
        filename, text = upload["filename"], upload["content"]
        if not filename.endswith((".yaml", ".yml", ".json", ".zip", ".tar.gz", ".tgz")):
            self._reject(what, [f"uploadfile: unexpected pipeline file {filename}"], upload=True)
        spec, errors = spec_from_yaml(text)
        if errors or spec is None:
            self._reject(what, errors, upload=True)
        return filename, spec

    def _upload_pipeline(self, query: dict[str, list[str]], body: Any) -> dict[str, Any]:
        filename, spec = self._uploaded("upload pipeline", body)
        q = {k: v[0] for k, v in query.items()}
        name = q.get("name") or q.get("display_name") or filename.split(".")[0]
        try:
            pipeline = self._store_pipeline(
                name, q.get("display_name", ""), q.get("namespace", ""), q.get("description", "")
            )
        except _Reply as reply:
            if reply.code == 409:
                raise _Reply(
                    _ALREADY_EXISTS,
                    "Failed to create a pipeline and a pipeline version",
                    upload=True,
                ) from None
            raise
        self._store_version(
            pipeline["pipeline_id"],
            name,
            pipeline["display_name"],
            spec,
            q.get("description", ""),
        )
        return copy.deepcopy(pipeline)

    def _upload_version(self, query: dict[str, list[str]], body: Any) -> dict[str, Any]:
        filename, spec = self._uploaded("upload pipeline version", body)
        q = {k: v[0] for k, v in query.items()}
        pipeline_id = q.get("pipelineid", "")
        if pipeline_id not in self.pipelines:  # the server cannot read its namespace: 400
            self._reject(
                "upload pipeline version",
                [f"pipelineid: pipeline {pipeline_id!r} not found"],
                upload=True,
            )
        name = q.get("name") or q.get("display_name") or filename.split(".")[0]
        version = self._store_version(
            pipeline_id, name, q.get("display_name", ""), spec, q.get("description", "")
        )
        return copy.deepcopy(version)

    # -- recurring runs

    def _trigger_errors(self, trigger: Any) -> list[str]:
        if not isinstance(trigger, dict) or not trigger:
            return ["trigger: required (cron_schedule or periodic_schedule)"]
        errors = unknown_fields(trigger, TRIGGER_FIELDS, "trigger.")
        cron, periodic = trigger.get("cron_schedule"), trigger.get("periodic_schedule")
        if bool(cron) == bool(periodic):
            return [*errors, "trigger: exactly one of cron_schedule, periodic_schedule"]
        if cron:
            errors += unknown_fields(cron, CRON_FIELDS, "trigger.cron_schedule.")
            why = robfig_cron_error(str(cron.get("cron") or ""))
            if why:
                errors.append(
                    "trigger.cron_schedule.cron: Schedule cron is not a supported format"
                    f"(https://godoc.org/github.com/robfig/cron). Error: {why}"
                )
        else:
            errors += unknown_fields(periodic, PERIODIC_FIELDS, "trigger.periodic_schedule.")
            interval = _int64(periodic.get("interval_second"))
            if interval is None or interval < 1:
                errors.append(
                    "trigger.periodic_schedule.interval_second: Found invalid period schedule "
                    f"interval {periodic.get('interval_second')}. Set at interval to least 1 second"
                )
        return errors

    def _create_recurring_run(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            self._reject("create recurring run", ["the body is not a JSON object"])
        errors = unknown_fields(body, RECURRING_RUN_FIELDS)
        name = body.get("display_name")
        if not isinstance(name, str) or not name.strip():
            errors.append("display_name: Recurring run's name cannot be empty")
        exp_id = self._experiment_of("recurring run", body, errors)
        mode = body.get("mode", "MODE_UNSPECIFIED")
        number = RECURRING_RUN_MODES.get(mode) if isinstance(mode, str) else _int64(mode)
        if number is None:  # the gateway's protojson decode: InvalidArgument
            errors.append(f'mode: invalid value for enum field mode: "{mode}"')
        elif number not in RECURRING_RUN_MODES.values():  # toModelJobEnabled's default
            message = (
                "Internal error: Failed to convert a API recurring run to its internal "
                "representation due to parsing error occurred in its mode field: Failed to "
                "convert API recurring run's mode to its internal representation: "
                f"Recurring run's mode is invalid: {number}"
            )
            self.errors.append(message)
            raise _Reply(_INTERNAL, message)
        concurrency = _int64(body.get("max_concurrency", 0))
        if concurrency is None or not 1 <= concurrency <= 10:
            errors.append(
                "max_concurrency: Max concurrency of a recurring run must be at least 1 and at "
                f"most 10. Received {body.get('max_concurrency', 0)}"
            )
        if "no_catchup" in body and not isinstance(body["no_catchup"], bool):
            errors.append("no_catchup: must be a boolean")
        errors += self._trigger_errors(body.get("trigger"))
        errors += self._spec_and_parameters(body)
        if errors:
            self._reject("create recurring run", errors)
        now = _now()
        enabled = number == RECURRING_RUN_MODES["ENABLE"]
        run = copy.deepcopy(body)
        run.update(
            recurring_run_id=str(uuid.uuid4()),
            mode="ENABLE" if enabled else "DISABLE",  # toApiRecurringRun: from Enabled
            max_concurrency=str(concurrency),  # int64: a string in protojson
            created_at=now,
            updated_at=now,
            status="ENABLED" if enabled else "DISABLED",
        )
        run["experiment_id"] = exp_id
        namespace = self.experiments[exp_id].get("namespace")
        if namespace:
            run["namespace"] = namespace
        self.recurring_runs[run["recurring_run_id"]] = run
        return copy.deepcopy(run)

    def _list_recurring_runs(self, query: dict[str, list[str]]) -> Any:
        items = list(self.recurring_runs.values())
        exp_id = (query.get("experiment_id") or [""])[0]
        namespace = (query.get("namespace") or [""])[0]
        if exp_id:
            items = [r for r in items if r.get("experiment_id") == exp_id]
        elif self.multi_user and not namespace:
            self._reject("list recurring runs", ["namespace: required in multi-user mode"])
        if namespace:
            items = [r for r in items if r.get("namespace", "") == namespace]
        items = self._filtered(items, query, "list recurring runs")
        return self._page(items, query, "recurring_runs")

    def _recurring_run_call(self, method: str, run_id: str, verb: str | None) -> Any:
        run = self._get(self.recurring_runs, "RecurringRun", run_id)
        if method == "GET" and not verb:
            return copy.deepcopy(run)
        if method == "DELETE" and not verb:
            del self.recurring_runs[run_id]
            return {}
        if method == "POST" and verb:
            enable = verb == ":enable"
            run.update(
                mode="ENABLE" if enable else "DISABLE",
                status="ENABLED" if enable else "DISABLED",
                updated_at=_now(),
            )
            return {}
        raise _Reply(_UNIMPLEMENTED, f"the fake KFP server does not serve {method} {run_id}")


def _multipart(content_type: str, raw: bytes) -> dict[str, Any]:
    """The file parts of a multipart/form-data body: {field: {filename, content}}."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + raw
    )
    parts: dict[str, Any] = {}
    for part in message.iter_parts():
        field = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True) or b""
        parts[str(field)] = {
            "filename": part.get_filename() or "",
            "content": payload.decode("utf-8", "replace"),
        }
    return parts


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeKfp

    def _serve(self) -> None:
        ctype = self.headers.get("Content-Type") or ""
        auth = self.headers.get("Authorization")
        try:
            if ctype.startswith("multipart/form-data"):
                length = int(self.headers.get("Content-Length") or 0)
                body: Any = _multipart(ctype, self.rfile.read(length))
            else:
                body = self._read_json()
        except ValueError:
            code, out = 400, {"error": "not JSON", "code": 3, "message": "not JSON", "details": []}
        else:
            headers = tuple((k, str(v)) for k, v in self.headers.items())
            code, out = self.fake.handle(self.command, self.path, body, auth, headers)
        self._send(code, out)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve


FakeKfp.handler = _Handler
FakeKfp.thread_name = "fake-kfp"
