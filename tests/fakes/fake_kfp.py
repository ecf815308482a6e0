"""A FAKE Kubeflow Pipelines API server, for what cannot run here (a cluster with KFP).

It serves the slice of the v2beta1 REST API that `kfp.Client.create_run_from_pipeline_package`
walks through: `GET /apis/v2beta1/healthz` (the client asks whether the deployment is
multi-user), `GET /apis/v2beta1/experiments?filter=...` (find the experiment by display
name), `POST /apis/v2beta1/experiments` (create it when missing), `POST /apis/v2beta1/runs`
(the run, with the compiled pipeline inline), and the GETs of one experiment or run.
Responses have the server's JSON shapes (snake_case fields, RFC 3339 times, a new run in
state PENDING, errors as grpc-gateway `{error, code, message, details}` bodies).

No pipeline runs. What makes it worth having is that a run create is checked the way the
real API server checks it, before it would hand the run to Argo:

- the body has only fields of a V2beta1Run (kfp_server_api's model is the schema), a
  display_name, and an experiment_id of an experiment that exists;
- pipeline_spec (bare, or `{pipeline_spec, platform_spec}` as the client sends a spec with
  a platform part) parses as the PipelineSpec (and PlatformSpec) protobuf of
  kfp-pipeline-spec, has pipelineInfo.name, root.dag and deploymentSpec, and every
  executorLabel and componentRef it names exists;
- every runtime_config parameter is a declared root input parameter of that spec and its
  JSON value fits the declared parameterType (NUMBER_INTEGER: an integral number,
  NUMBER_DOUBLE: a number, STRING, BOOLEAN, LIST, STRUCT; a bool is never a number), and no
  required root parameter (no default, not optional) is left out.

Anything else gets HTTP 400 naming the field, as from the real server, and is recorded in
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
import json
import re
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlsplit

import kfp_server_api
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from .http_fake import JsonHandler, LoopbackFake

API = "/apis/v2beta1"

# grpc status codes the gateway puts in error bodies
_INVALID_ARGUMENT, _NOT_FOUND, _ALREADY_EXISTS, _UNIMPLEMENTED = 3, 5, 6, 12
_HTTP = {_INVALID_ARGUMENT: 400, _NOT_FOUND: 404, _ALREADY_EXISTS: 409, _UNIMPLEMENTED: 501}

# the fields the server's protobuf messages have (the generated client's models mirror them)
RUN_FIELDS = frozenset(kfp_server_api.V2beta1Run.attribute_map.values())
RUNTIME_CONFIG_FIELDS = frozenset(kfp_server_api.V2beta1RuntimeConfig.attribute_map.values())
EXPERIMENT_FIELDS = frozenset(kfp_server_api.V2beta1Experiment.attribute_map.values())

_EXPERIMENT = re.compile(rf"^{API}/experiments/(?P<id>[^/:]+)$")
_RUN = re.compile(rf"^{API}/runs/(?P<id>[^/:]+)$")


@dataclass(frozen=True)
class Recorded:
    """One request as the fake received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


class _Reply(Exception):
    """Ends a request with a grpc-gateway error body."""

    def __init__(self, grpc_code: int, message: str) -> None:
        super().__init__(message)
        self.code = _HTTP[grpc_code]
        self.body = {"error": message, "code": grpc_code, "message": message, "details": []}


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


class FakeKfp(LoopbackFake):
    """The fake KFP API server; a context manager that serves on 127.0.0.1 on a free port."""

    def __init__(self, *, multi_user: bool = False) -> None:
        super().__init__()
        self.multi_user = multi_user
        self._lock = threading.RLock()
        self.experiments: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, dict[str, Any]] = {}
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

    # ------------------------------------------------------------ request handling

    def handle(self, method: str, raw_path: str, body: Any) -> tuple[int, Any]:
        parts = urlsplit(raw_path)
        query = parse_qs(parts.query)
        path = parts.path.rstrip("/")
        with self._lock:
            self.requests.append(Recorded(method, path, query, copy.deepcopy(body)))
            try:
                return 200, self._route(method, path, query, body)
            except _Reply as reply:
                return reply.code, reply.body
            except Exception as err:  # a body shape the checks did not foresee: still answer
                self.errors.append(f"{method} {path}: the fake failed: {err!r}")
                return 500, {"error": repr(err), "code": 13, "message": repr(err), "details": []}

    def _route(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> Any:
        if (method, path) == ("GET", f"{API}/healthz"):
            return {"multi_user": self.multi_user, "pipeline_store": "database"}
        if path == f"{API}/experiments":
            if method == "GET":
                return self._list_experiments(query)
            if method == "POST":
                return self._create_experiment(body)
        if (m := _EXPERIMENT.match(path)) and method == "GET":
            if m["id"] not in self.experiments:
                raise _Reply(_NOT_FOUND, f"Experiment {m['id']} not found")
            return copy.deepcopy(self.experiments[m["id"]])
        if path == f"{API}/runs" and method == "POST":
            return self._create_run(body)
        if (m := _RUN.match(path)) and method == "GET":
            if m["id"] not in self.runs:
                raise _Reply(_NOT_FOUND, f"Run {m['id']} not found")
            return copy.deepcopy(self.runs[m["id"]])
        raise _Reply(_UNIMPLEMENTED, f"the fake KFP server does not serve {method} {path}")

    def _reject(self, what: str, errors: list[str]) -> NoReturn:
        self.errors += [f"{what}: {e}" for e in errors]
        raise _Reply(_INVALID_ARGUMENT, f"Invalid input error: {what}: " + "; ".join(errors))

    # -- experiments

    def _list_experiments(self, query: dict[str, list[str]]) -> dict[str, Any]:
        namespace = (query.get("namespace") or [""])[0]
        if self.multi_user and not namespace:
            self._reject("list experiments", ["namespace: required in multi-user mode"])
        items = [e for e in self.experiments.values() if e.get("namespace", "") == namespace]
        raw_filter = (query.get("filter") or [""])[0]
        if raw_filter:
            try:
                predicates = json.loads(raw_filter).get("predicates") or []
            except (ValueError, AttributeError):
                self._reject("list experiments", [f"filter: not a JSON filter: {raw_filter}"])
            for pred in predicates:
                if pred.get("operation") not in (1, "EQUALS"):
                    self._reject("list experiments", [f"filter: unsupported predicate {pred}"])
                key, want = pred.get("key"), pred.get("stringValue", pred.get("string_value"))
                items = [e for e in items if e.get(key) == want]
        if not items:
            return {}  # the gateway leaves out empty fields
        return {"experiments": copy.deepcopy(items), "total_size": len(items)}

    def _create_experiment(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            self._reject("create experiment", ["the body is not a JSON object"])
        errors = [f"{k}: unknown field" for k in sorted(set(body) - EXPERIMENT_FIELDS)]
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
                raise _Reply(_ALREADY_EXISTS, f"Experiment {name} already exists")
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

    # -- runs

    def _create_run(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            self._reject("create run", ["the body is not a JSON object"])
        errors = [f"{k}: unknown field" for k in sorted(set(body) - RUN_FIELDS)]
        name = body.get("display_name")
        if not isinstance(name, str) or not name.strip():
            errors.append("display_name: required")
        exp_id = body.get("experiment_id")
        if not exp_id:
            errors.append("experiment_id: required")
        elif not isinstance(exp_id, str) or exp_id not in self.experiments:
            errors.append(f"experiment_id: experiment {exp_id} not found")
        spec = body.get("pipeline_spec")
        spec_errors: list[str] = []
        if body.get("pipeline_version_reference"):
            errors.append("pipeline_version_reference: no pipelines are uploaded to this fake")
        elif spec is None:
            errors.append("pipeline_spec: required (or pipeline_version_reference)")
        else:
            spec_errors = pipeline_spec_errors(spec)
            errors += spec_errors
        runtime = body.get("runtime_config") or {}
        if not isinstance(runtime, dict):
            errors.append("runtime_config: must be an object")
        else:
            errors += [
                f"runtime_config.{k}: unknown field"
                for k in sorted(set(runtime) - RUNTIME_CONFIG_FIELDS)
            ]
            if isinstance(spec, dict) and not spec_errors:
                errors += runtime_parameter_errors(spec, runtime.get("parameters"))
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
        self.runs[run["run_id"]] = run
        self.experiments[str(exp_id)]["last_run_created_at"] = now
        return copy.deepcopy(run)


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeKfp

    def _serve(self) -> None:
        try:
            body = self._read_json()
        except ValueError:
            code, out = 400, {"error": "not JSON", "code": 3, "message": "not JSON", "details": []}
        else:
            code, out = self.fake.handle(self.command, self.path, body)
        self._send(code, out)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve


FakeKfp.handler = _Handler
FakeKfp.thread_name = "fake-kfp"
