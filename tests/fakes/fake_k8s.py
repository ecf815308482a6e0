"""A FAKE Kubernetes API server, for what cannot run here (a cluster with the Training
Operator, Katib and KServe).

It serves the slice of the REST API the kubernetes Python client uses for custom objects
(`/apis/{group}/{version}/namespaces/{ns}/{plural}[/{name}]`: POST, GET, LIST with
labelSelector, PUT, merge PATCH, DELETE) and for pods (list with labelSelector, log).
No controller runs: the test scripts each object's status. What makes it worth having is
that every created or replaced body is validated against the real upstream schemas vendored
in tests/fixtures/crds (see k8s_schemas.py); an invalid body gets HTTP 422 naming the field, as
from a real API server, and is recorded in `errors` so a test can assert there were none.

    with FakeK8s(crds_dir()) as fake:
        fake.script_status("pytorchjobs", "job", [RUNNING, SUCCEEDED])
        fake.add_pod("default", "job-master-0", {...labels...}, log="eval_loss=1.5\\n")
        PyTorchJobTrainer(fake.api_client(), poll_interval_s=0.05).run(job)
        assert fake.errors == []
"""

from __future__ import annotations

import copy
import itertools
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s

from .http_fake import JsonHandler, LoopbackFake
from .k8s_schemas import Validator, crds_dir, missing_files, missing_reason, validators


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    kind: str


RESOURCES = {
    "pytorchjobs": Kind("kubeflow.org", "v1", "PyTorchJob"),
    "experiments": Kind("kubeflow.org", "v1beta1", "Experiment"),
    "trials": Kind("kubeflow.org", "v1beta1", "Trial"),
    "inferenceservices": Kind("serving.kserve.io", "v1beta1", "InferenceService"),
}


@dataclass(frozen=True)
class Recorded:
    """One request as the fake received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


Key = tuple[str, str, str]  # plural, namespace, name
OnCreate = Callable[["FakeK8s", dict[str, Any]], None]

_CUSTOM = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?$"
)
_PODS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods(?:/(?P<name>[^/]+))?(?P<log>/log)?$")


class _Reply(Exception):
    """Ends a request with this status code and body (a Status object, or text)."""

    def __init__(self, code: int, body: Any) -> None:
        super().__init__(code)
        self.code, self.body = code, body


def status_body(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A metav1.Status, the body the API server sends with every error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors (`a=b,c==d,e!=f,g,!h`), what the clients here send."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = re.split(r"==?", term, maxsplit=1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class FakeK8s(LoopbackFake):
    """The fake API server; a context manager that serves on 127.0.0.1 on a free port."""

    def __init__(self, crds: Path | None = None) -> None:
        super().__init__()
        self.crds = crds or crds_dir()
        if missing_files(self.crds):
            # Without its schemas the fake would accept anything; that must not pass quietly.
            raise FileNotFoundError(missing_reason(self.crds))
        self._validators: dict[str, Validator] = validators(self.crds)
        self._lock = threading.RLock()
        self._objects: dict[Key, dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._logs: dict[tuple[str, str], str] = {}
        self._scripts: dict[Key, list[dict[str, Any]]] = {}
        self._on_create: dict[str, list[OnCreate]] = {}
        self._failures: list[tuple[str, str, int]] = []  # method, path substring, code
        self._version = itertools.count(1)
        self.requests: list[Recorded] = []
        self.errors: list[str] = []  # every validation error, across requests
        self.deleted: list[Key] = []

    def api_client(self) -> k8s.ApiClient:
        """A kubernetes ApiClient pointed at this fake."""
        cfg = k8s.Configuration()
        cfg.host = self.url
        return k8s.ApiClient(cfg)

    # ------------------------------------------------------------ test controls

    def set_status(
        self, plural: str, name: str, status: dict[str, Any], namespace: str = "default"
    ) -> None:
        """Replace the status of an existing object, as its controller would."""
        with self._lock:
            self._apply_status((plural, namespace, name), status)

    def _apply_status(self, key: Key, status: dict[str, Any]) -> None:
        """Set a status, checked against the schema too: a scripted status must be one the
        real controller could write, or the test proves nothing about reading it."""
        obj = self._objects[key]
        obj["status"] = copy.deepcopy(status)
        self.errors += [f"{key[0]}/{key[2]} status: {e}" for e in self.validate(key[0], obj)]

    def script_status(
        self,
        plural: str,
        name: str,
        statuses: list[dict[str, Any]],
        namespace: str = "default",
    ) -> None:
        """Statuses the object takes one by one, each on a GET of it; the last one stays.

        The script may be set before the object exists (the code under test creates it).
        """
        with self._lock:
            self._scripts[(plural, namespace, name)] = [copy.deepcopy(s) for s in statuses]

    def on_create(self, plural: str, callback: OnCreate) -> None:
        """Call `callback(fake, obj)` after each create of `plural` (e.g. to add its pods)."""
        self._on_create.setdefault(plural, []).append(callback)

    def fail(self, method: str, path_part: str, code: int, times: int = 1) -> None:
        """Answer the next `times` requests whose path contains `path_part` with `code`."""
        with self._lock:
            self._failures += [(method, path_part, code)] * times

    def add_pod(
        self,
        namespace: str,
        name: str,
        labels: dict[str, str],
        log: str = "",
        phase: str = "Succeeded",
    ) -> None:
        with self._lock:
            self._pods[(namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
                "status": {"phase": phase},
            }
            self._logs[(namespace, name)] = log

    def put_object(self, plural: str, obj: dict[str, Any]) -> None:
        """Store an object as a controller would create it (no validation), e.g. Trials."""
        meta = obj["metadata"]
        with self._lock:
            self._objects[(plural, meta.get("namespace", "default"), meta["name"])] = self._stamp(
                copy.deepcopy(obj), meta.get("namespace", "default")
            )

    def get_object(
        self, plural: str, name: str, namespace: str = "default"
    ) -> dict[str, Any] | None:
        with self._lock:
            obj = self._objects.get((plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def created(self, plural: str) -> list[dict[str, Any]]:
        """Bodies POSTed for `plural`, as sent (valid or not)."""
        return [
            r.body
            for r in self.requests
            if r.method == "POST" and (m := _CUSTOM.match(r.path)) and m["plural"] == plural
        ]

    def validate(self, plural: str, body: dict[str, Any]) -> list[str]:
        """Errors of `body` against the schema of `plural` (empty when valid)."""
        check = self._validators.get(plural)
        return check(body) if check else []

    # ------------------------------------------------------------ request handling

    def handle(self, method: str, raw_path: str, body: Any) -> tuple[int, Any]:
        parts = urlsplit(raw_path)
        query = parse_qs(parts.query)
        with self._lock:
            self.requests.append(Recorded(method, parts.path, query, copy.deepcopy(body)))
            for i, (verb, part, code) in enumerate(self._failures):
                if verb == method and part in parts.path:
                    del self._failures[i]
                    return code, status_body(code, "InternalError", "injected by the test")
        try:
            if m := _CUSTOM.match(parts.path):
                return self._custom(method, m, query, body)
            if m := _PODS.match(parts.path):
                return self._pod(method, m, query)
            raise _Reply(404, status_body(404, "NotFound", f"no route for {parts.path}"))
        except _Reply as reply:
            return reply.code, reply.body

    def _custom(
        self, method: str, m: re.Match[str], query: dict[str, list[str]], body: Any
    ) -> tuple[int, Any]:
        plural, ns, name = m["plural"], m["ns"], m["name"]
        kind = RESOURCES.get(plural)
        if kind is None or (kind.group, kind.version) != (m["group"], m["version"]):
            raise _Reply(404, status_body(404, "NotFound", f"the server could not find {m[0]}"))
        with self._lock:
            if name is None:
                if method == "GET":
                    selector = (query.get("labelSelector") or [""])[0]
                    items = [
                        copy.deepcopy(o)
                        for (p, n, _), o in sorted(self._objects.items())
                        if p == plural
                        and n == ns
                        and selector_matches(selector, o["metadata"].get("labels") or {})
                    ]
                    return 200, {
                        "apiVersion": f"{kind.group}/{kind.version}",
                        "kind": f"{kind.kind}List",
                        "metadata": {"resourceVersion": str(next(self._version))},
                        "items": items,
                    }
                if method == "POST":
                    return 201, self._create(plural, kind, ns, body)
                raise _Reply(405, status_body(405, "MethodNotAllowed", method))
            key = (plural, ns, name)
            current = self._objects.get(key)
            if current is None:
                raise _Reply(
                    404, status_body(404, "NotFound", f'{plural} "{name}" not found', name=name)
                )
            if method == "GET":
                script = self._scripts.get(key)
                if script:
                    self._apply_status(key, script.pop(0) if len(script) > 1 else script[0])
                return 200, copy.deepcopy(current)
            if method == "DELETE":
                del self._objects[key]
                self.deleted.append(key)
                return 200, current
            if method in ("PUT", "PATCH"):
                if method == "PATCH":
                    body = merge_patch(copy.deepcopy(current), body)
                return 200, self._replace(key, kind, current, body)
            raise _Reply(405, status_body(405, "MethodNotAllowed", method))

    def _check(self, plural: str, kind: Kind, ns: str, body: Any) -> None:
        if not isinstance(body, dict):
            raise _Reply(400, status_body(400, "BadRequest", "the body is not a JSON object"))
        errors = []
        if body.get("apiVersion") != f"{kind.group}/{kind.version}":
            errors.append(f"apiVersion: expected {kind.group}/{kind.version}")
        if body.get("kind") != kind.kind:
            errors.append(f"kind: expected {kind.kind}")
        body_ns = (body.get("metadata") or {}).get("namespace")
        if body_ns not in (None, ns):
            errors.append(f"metadata.namespace: {body_ns} does not match the URL's {ns}")
        errors += self.validate(plural, body)
        if errors:
            name = (body.get("metadata") or {}).get("name", "")
            self.errors += [f"{plural}/{name}: {e}" for e in errors]
            raise _Reply(
                422,
                status_body(
                    422,
                    "Invalid",
                    f'{kind.kind}.{kind.group} "{name}" is invalid: ' + "; ".join(errors),
                    name=name,
                    kind=kind.kind,
                    causes=[
                        {"reason": "FieldValueInvalid", "field": e.split(":", 1)[0], "message": e}
                        for e in errors
                    ],
                ),
            )

    def _stamp(self, obj: dict[str, Any], ns: str) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        meta["namespace"] = ns
        meta.setdefault("uid", f"uid-{next(self._version)}")
        meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._version))
        return obj

    def _create(self, plural: str, kind: Kind, ns: str, body: Any) -> dict[str, Any]:
        self._check(plural, kind, ns, body)
        name = body["metadata"]["name"]
        key = (plural, ns, name)
        if key in self._objects:
            raise _Reply(
                409,
                status_body(409, "AlreadyExists", f'{plural} "{name}" already exists', name=name),
            )
        obj = self._stamp(copy.deepcopy(body), ns)
        obj.pop("status", None)  # status is the controller's (a subresource)
        self._objects[key] = obj
        for callback in self._on_create.get(plural, []):
            callback(self, copy.deepcopy(obj))
        return copy.deepcopy(self._objects[key])

    def _replace(self, key: Key, kind: Kind, current: dict[str, Any], body: Any) -> dict[str, Any]:
        plural, ns, name = key
        self._check(plural, kind, ns, body)
        sent_version = (body.get("metadata") or {}).get("resourceVersion")
        if sent_version not in (None, current["metadata"]["resourceVersion"]):
            raise _Reply(
                409,
                status_body(409, "Conflict", f'{plural} "{name}": the object has been modified'),
            )
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "generation"):
            meta[field] = current["metadata"][field]
        if obj.get("spec") != current.get("spec"):
            meta["generation"] = current["metadata"]["generation"] + 1
        obj["status"] = current.get("status")  # PUT on the main resource keeps status
        if obj["status"] is None:
            del obj["status"]
        self._objects[key] = self._stamp(obj, ns)
        return copy.deepcopy(obj)

    def _pod(self, method: str, m: re.Match[str], query: dict[str, list[str]]) -> tuple[int, Any]:
        if method != "GET":
            raise _Reply(405, status_body(405, "MethodNotAllowed", method))
        ns, name = m["ns"], m["name"]
        with self._lock:
            if name is None:
                selector = (query.get("labelSelector") or [""])[0]
                items = [
                    copy.deepcopy(p)
                    for (n, _), p in sorted(self._pods.items())
                    if n == ns and selector_matches(selector, p["metadata"]["labels"])
                ]
                return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
            if (ns, name) not in self._pods:
                raise _Reply(404, status_body(404, "NotFound", f'pods "{name}" not found'))
            if m["log"]:
                return 200, self._logs[(ns, name)]
            return 200, copy.deepcopy(self._pods[(ns, name)])


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeK8s

    def _serve(self) -> None:
        try:
            body = self._read_json()
        except ValueError:
            self._send(400, status_body(400, "BadRequest", "the body is not JSON"))
            return
        kind = self.headers.get("Content-Type", "")
        if self.command == "PATCH" and "merge-patch" not in kind:
            self._send(415, status_body(415, "UnsupportedMediaType", f"only merge patch: {kind}"))
            return
        code, out = self.fake.handle(self.command, self.path, body)
        self._send(code, out)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve


FakeK8s.handler = _Handler
FakeK8s.thread_name = "fake-k8s"
