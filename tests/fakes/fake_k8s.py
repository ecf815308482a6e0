"""A FAKE Kubernetes API server, for what cannot run here (a cluster with the Training
Operator, Katib and KServe). With the controllers of sim_cluster.py it is a small cluster.

It serves the slice of the REST API the kubernetes Python client uses, for custom objects
(`/apis/{group}/{version}[/namespaces/{ns}]/{plural}[/{name}[/status]]`) and pods
(`/api/v1[/namespaces/{ns}]/pods[/{name}[/log|/status]]`): create, get, list, watch, replace,
merge patch, delete (with the garbage collector's cascade), deletecollection, the status
subresource and pod logs (`follow`, `tailLines`); and ConfigMaps and Secrets
(`/api/v1/namespaces/{ns}/configmaps|secrets[/{name}]`) read-only, get and list, from the
dicts `config_maps` and `secrets` (what the KFP driver and launcher read: kfp_runtime.py).
What makes it worth having is that it is strict where a real API server is:

- every created or replaced body is validated against the real upstream schemas vendored in
  tests/fixtures/crds (see k8s_schemas.py); an invalid body gets HTTP 422 naming the field
  and is recorded in `errors`, so a test can assert there were none;
- every request is authorized against the Role in manifests/base/rbac.yaml as RBAC does
  (k8s_rbac.py); a refused one gets HTTP 403 with the API server's message and is recorded
  in `forbidden`;
- every mutation bumps one global resourceVersion and appends a watch event to a bounded
  history, so watches behave as they do against the API server's watch cache (see `Watch`
  below): replay from a resourceVersion, 410 Expired once it has left the history, label
  and field selectors, bookmarks, `timeoutSeconds`, and drops.

    with FakeK8s(crds_dir()) as fake:
        fake.script_status("pytorchjobs", "job", [RUNNING, SUCCEEDED])
        fake.add_pod("default", "job-master-0", {...labels...}, log="eval_loss=1.5\\n")
        PyTorchJobTrainer(fake.api_client(), poll_interval_s=0.05).run(job)
        assert fake.errors == [] and fake.forbidden == []

Watch (k8s.io/apiserver/pkg/storage/cacher, and the API concepts page "Efficient detection of
changes"): `?watch=true` (or `1`) on a collection streams newline-delimited JSON events
`{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}` in a chunked response.
resourceVersion unset or "0" starts with synthetic ADDED events for what exists now;
resourceVersion=N replays the retained events after N, then streams live ones; N older than
the retained history gets one ERROR event carrying Status 410 Expired
("too old resource version: N (oldest)"), as from the watch cache, and the stream ends. An
object that starts or stops matching the selectors arrives as ADDED or DELETED
(cache_watcher.go `convertToWatchEvent`). `allowWatchBookmarks=true` adds a BOOKMARK every
`bookmark_s` of silence. `timeoutSeconds` ends the stream cleanly (the terminating chunk).
`drop_watches()` ends every open stream abruptly (the connection closes mid-stream, as when
an API server restarts: the client sees a broken chunked read); `drop_watches(clean=True)`
ends them as the server's own watch timeout does. `compact()` forgets the history.

Scripted statuses (`script_status`) advance one step on each GET of the object, as before,
and also one step per `script_step_s` of silence on each open watch whose filters match it,
so a client that only watches sees them too (each step a MODIFIED event).

Pods are stored objects like the rest (ADDED/MODIFIED/DELETED events, labels, field
selectors status.phase & co, ownerReferences, the status the kubelet writes). Their log
(`pods/{name}/log`) is text; `follow=true` streams it as it grows and ends when the pod has
terminated (Succeeded/Failed) or is deleted; `tailLines=N` starts from the last N lines; a
pod whose container has not started answers 400 `container "c" in pod "p" is waiting to
start: ContainerCreating` (the kubelet's answer), so a client must wait for Running.

Test controls (Python calls, thread-safe, never authorized, each emitting the watch events
the same change over HTTP would): set_status, patch_status, script_status, on_create,
on_admit (a mutating webhook: Katib's pod webhook), on_validate (a validating one: Katib's
experiment webhook), on_delete, add_listener, fail, add_pod,
set_pod_phase, append_log, pod_log, put_object,
create_object, delete_object, get_object, list_objects, created, validate, history,
drop_watches, compact; records: requests, errors, deleted, forbidden.

Cluster-scoped kinds (`CLUSTER_SCOPED`: ClusterTrainingRuntime) are stored under namespace ""
and served only at paths without /namespaces/{ns} (a namespaced path is 404).

Simplifications: no namespaces as objects, no admission besides the schema and webhook
checks (no defaulting webhooks: stored objects are what was sent), list ignores
`limit`/`continue`/`resourceVersion` (always the latest, complete), no finalizers, graceful
pod deletion is immediate (the object goes at once; the sim's kubelet then stops the
process), foreground deletion marks the owner (deletionTimestamp, a MODIFIED event) and
deletes the dependents before it, the garbage collector runs synchronously inside the
delete, a resourceVersion ahead of the server is accepted instead of waiting then answering
504, and only merge patch is applied: a patch type the resource's handler does not serve
(strategic merge patch on a custom resource) gets the API server's 415, and one it serves but
the fake does not apply (JSON patch, apply patch; strategic merge patch on a pod) a 415 that
says so.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import random
import re
import select
import socket
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s

from .http_fake import JsonHandler, LoopbackFake
from .k8s_rbac import REPO_RBAC, Attributes, Denied, Role, status_forbidden, verb_of
from .k8s_schemas import Validator, crds_dir, missing_files, missing_reason, validators
from .qos import pod_qos


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES = {
    "pytorchjobs": Kind("kubeflow.org", "v1", "PyTorchJob"),
    "experiments": Kind("kubeflow.org", "v1beta1", "Experiment"),
    "trials": Kind("kubeflow.org", "v1beta1", "Trial"),
    "inferenceservices": Kind("serving.kserve.io", "v1beta1", "InferenceService"),
    "pods": Kind("", "v1", "Pod"),
    # Trainer v2 (trainer_v2.py) and JobSet with its child Jobs (jobset.py)
    "trainjobs": Kind("trainer.kubeflow.org", "v1alpha1", "TrainJob"),
    "clustertrainingruntimes": Kind("trainer.kubeflow.org", "v1alpha1", "ClusterTrainingRuntime"),
    "jobsets": Kind("jobset.x-k8s.io", "v1alpha2", "JobSet"),
    "jobs": Kind("batch", "v1", "Job"),
}
# Cluster-scoped kinds: stored under namespace "", served only without /namespaces/{ns}
# (SIMPLIFIED: get, list, create, delete, replace; no watch of their own beyond the shared one).
CLUSTER_SCOPED = frozenset({"clustertrainingruntimes"})
# Core objects served read-only from plain dicts (`FakeK8s.config_maps` / `FakeK8s.secrets`,
# which SimCluster shares as `sim.config_maps` / `sim.secrets`): (namespace, name) -> the
# string data. The KFP driver and launcher GET them (fakes/kfp_runtime.py).
CORE_STORES = {"configmaps": "ConfigMap", "secrets": "Secret"}
# The subresources served per plural (everything else under a name is 404).
SUBRESOURCES = {"pods": ("log", "status")}
DEFAULT_SUBRESOURCES = ("status",)
TERMINAL_PHASES = ("Succeeded", "Failed")

# PATCH media types (k8s.io/apimachinery pkg/types/patch.go). The CRD handler serves JSON,
# merge and apply patches (apiextensions-apiserver customresource_handler.go#L322-L326), the
# built-in kinds' handler strategic merge patch too (apiserver endpoints/installer.go#L874-
# L879); the fake applies merge patches only.
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
CUSTOM_RESOURCE_PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, APPLY_PATCH)
BUILTIN_PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH)


class _NotJson:
    """A PATCH body that does not parse: 400 once its media type is accepted."""

    def __deepcopy__(self, memo: Any) -> _NotJson:
        return self

    def __repr__(self) -> str:
        return "<not JSON>"


NOT_JSON = _NotJson()


@dataclass(frozen=True)
class Recorded:
    """One request as the fake received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


@dataclass(frozen=True)
class Event:
    """One entry of the watch history: the object after the change, and before it."""

    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    plural: str
    namespace: str
    name: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass
class Stream:
    """A streamed response body (watch events, a followed log), written as HTTP chunks.

    `peer` is the client's socket once the handler serves it: an idle stream checks it so
    that a client that went away (a stopped Watch) frees its server thread at once.
    """

    content_type: str
    chunks: Iterator[bytes] = field(default_factory=lambda: iter(()))
    peer: socket.socket | None = None

    def client_gone(self) -> bool:
        if self.peer is None:
            return False
        try:
            readable, _, _ = select.select([self.peer], [], [], 0)
            return bool(readable) and self.peer.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


ABORT = b"\x00abort"  # a chunk that tells the handler to drop the connection mid-stream

Key = tuple[str, str, str]  # plural, namespace, name
OnCreate = Callable[["FakeK8s", dict[str, Any]], None]
OnDelete = Callable[["FakeK8s", dict[str, Any]], None]
# A mutating admission webhook: (fake, body, namespace) -> the body to store (or ApiError).
Mutate = Callable[["FakeK8s", dict[str, Any], str], dict[str, Any]]
# A validating admission webhook: (fake, body, the stored object on UPDATE else None,
# namespace) -> None, or raises ApiError to refuse the request.
Validate = Callable[["FakeK8s", dict[str, Any], dict[str, Any] | None, str], None]
Listener = Callable[[Event], None]

_CUSTOM = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
_CORE = re.compile(
    r"^/api/(?P<version>v1)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
# Field selectors the API server supports (every kind: name and namespace; pods: their
# registry's PodToSelectableFields in pkg/registry/core/pod/strategy.go).
_FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "metadata.name": lambda o: o["metadata"].get("name", ""),
    "metadata.namespace": lambda o: o["metadata"].get("namespace", ""),
}
_POD_FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    **_FIELDS,
    "status.phase": lambda o: (o.get("status") or {}).get("phase", ""),
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName", ""),
    "spec.restartPolicy": lambda o: (o.get("spec") or {}).get("restartPolicy", ""),
    "spec.serviceAccountName": lambda o: (o.get("spec") or {}).get("serviceAccountName", ""),
    "status.podIP": lambda o: (o.get("status") or {}).get("podIP", ""),
}


@dataclass(frozen=True)
class Route:
    group: str
    version: str
    namespace: str  # "" for a request across namespaces
    plural: str
    name: str  # "" for a collection
    sub: str


class ApiError(Exception):
    """A request (or a test control) answered with this status code and Status body."""

    def __init__(self, code: int, body: Any) -> None:
        super().__init__(f"{code}: {body.get('message') if isinstance(body, dict) else body}")
        self.code, self.body = code, body


_Reply = ApiError


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


def unsupported_patch(content_type: str, builtin: bool) -> ApiError | None:
    """The 415 for a PATCH whose Content-Type the fake does not apply, or None.

    As PatchResource (k8s.io/apiserver pkg/endpoints/handlers/patch.go#L73-L84): the media type
    is the header up to any `;`, and one the resource's handler does not serve is 415
    UnsupportedMediaType "the body of the request was in an unknown format - accepted media
    types include: <the handler's types>" (a strategic merge patch on a custom resource).
    One it serves but the fake does not apply (JSON patch, apply patch, and a strategic merge
    patch on a pod) is 415 too, where upstream applies it: kubellm sends merge patches only.
    """
    media = content_type.split(";", 1)[0] if content_type.find(";") > 0 else content_type
    accepted = BUILTIN_PATCH_TYPES if builtin else CUSTOM_RESOURCE_PATCH_TYPES
    if media not in accepted:
        message = (
            "the body of the request was in an unknown format - accepted media types "
            f"include: {', '.join(accepted)}"
        )
    elif media != MERGE_PATCH:
        message = f"the fake applies only {MERGE_PATCH} patches, not {media}"
    else:
        return None
    return ApiError(415, status_body(415, "UnsupportedMediaType", message))


_LOG_LINE = re.compile(r"[^\n]*\n|[^\n]+$")  # a log's lines, the last maybe without "\n"


def tail_line_start(text: str, n: int) -> int:
    """Where the last `n` lines of a log start, as the kubelet's log reader finds them
    (k8s.io/cri-client pkg/logs/tail.go findTailLineStartIndex): the start for n < 0, else
    the start of the last n lines, a last line without a newline not counted."""
    if n < 0:
        return 0
    newlines = text.count("\n")
    start = 0
    for _ in range(max(newlines - n, 0)):
        start = text.index("\n", start) + 1
    return start


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


def _split_terms(selector: str) -> list[str]:
    """Terms of a selector: commas split them, except inside `in (a, b)`."""
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            terms.append(cur.strip())
            cur = ""
        else:
            cur += ch
    terms.append(cur.strip())
    return [t for t in terms if t]


_SET_TERM = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s+\((?P<values>[^)]*)\)$")


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Label selectors as k8s.io/apimachinery/pkg/labels parses them: equality-based
    (`a=b,c==d,e!=f`), existence (`g`, `!h`) and set-based (`k in (a,b)`, `k notin (a)`).
    ValueError on a term it cannot parse (the API server answers 400)."""
    for term in _split_terms(selector):
        if m := _SET_TERM.match(term):
            values = {v.strip() for v in m["values"].split(",") if v.strip()}
            present = m["key"] in labels and labels[m["key"]] in values
            if present != (m["op"] == "in"):
                return False
        elif "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = re.split(r"==?", term, maxsplit=1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif re.fullmatch(r"[A-Za-z0-9./_-]+", term):
            if term not in labels:
                return False
        else:
            raise ValueError(f"unable to parse requirement: {term!r}")
    return True


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_reference(owner: dict[str, Any], controller: bool = True) -> dict[str, Any]:
    """The ownerReference a controller puts on what it creates for `owner`."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


@dataclass
class _WatchSpec:
    plural: str
    namespace: str
    labels: str
    fields: list[tuple[str, str, str]] = field(default_factory=list)  # key, op, value


class FakeK8s(LoopbackFake):
    """The fake API server; a context manager that serves on 127.0.0.1 on a free port.

    crds: the directory of upstream schemas (default: the vendored ones).
    rbac: a manifest with the Role to enforce on HTTP requests (default: the repo's
      manifests/base/rbac.yaml; None: allow everything). Test controls bypass it.
    history: how many watch events are retained (older resourceVersions get 410).
    script_step_s: the pace at which open watches advance scripted statuses.
    bookmark_s: the silence after which a watch that allows bookmarks gets one.
    """

    def __init__(
        self,
        crds: Path | None = None,
        rbac: Path | str | None = REPO_RBAC,
        *,
        history: int = 1000,
        script_step_s: float = 0.05,
        bookmark_s: float = 1.0,
    ) -> None:
        super().__init__()
        self.crds = crds or crds_dir()
        if missing_files(self.crds):
            # Without its schemas the fake would accept anything; that must not pass quietly.
            raise FileNotFoundError(missing_reason(self.crds))
        self._validators: dict[str, Validator] = validators(self.crds)
        self.role: Role | None = Role(Path(rbac)) if rbac is not None else None
        self.script_step_s = script_step_s
        self.bookmark_s = bookmark_s
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._objects: dict[Key, dict[str, Any]] = {}
        self._logs: dict[tuple[str, str], str] = {}
        self._scripts: dict[Key, list[dict[str, Any]]] = {}
        self._on_create: dict[str, list[OnCreate]] = {}
        self._on_delete: dict[str, list[OnDelete]] = {}
        self._mutators: dict[str, list[Mutate]] = {}  # on_admit
        self._validators_hooks: dict[str, list[Validate]] = {}  # on_validate
        self._listeners: list[Listener] = []
        self._failures: list[tuple[str, str, int]] = []  # method, path substring, code
        # Never 0: a list's resourceVersion "0" would mean "any" to a watch (etcd starts at 1).
        self._rv = 1
        self._history: deque[Event] = deque()
        self._history_max = history
        self._oldest_rv = 1  # a watch from below this has lost events: 410
        self._epoch = 0  # bumped by drop_watches
        self._drop_clean = False
        self._closing = False
        # ConfigMaps and Secrets: (namespace, name) -> string data (see CORE_STORES)
        self.config_maps: dict[tuple[str, str], dict[str, str]] = {}
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.requests: list[Recorded] = []
        self.errors: list[str] = []  # every validation error, across requests
        self.deleted: list[Key] = []
        self.forbidden: list[Denied] = []

    def api_client(self) -> k8s.ApiClient:
        """A kubernetes ApiClient pointed at this fake."""
        cfg = k8s.Configuration()
        cfg.host = self.url
        return k8s.ApiClient(cfg)

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig file pointing at this fake (for code in child processes)."""
        import yaml

        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                }
            ],
            "current-context": "fake",
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(cfg))
        return path

    def stop(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        super().stop()

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion (what a list answers with)."""
        with self._lock:
            return self._rv

    # ------------------------------------------------------------ test controls
    # Python calls, for tests and the sim's controllers: thread-safe, never authorized,
    # each emitting the watch events the same change made over HTTP would.

    def set_status(
        self, plural: str, name: str, status: dict[str, Any], namespace: str = "default"
    ) -> None:
        """Replace the status of an existing object, as its controller would."""
        with self._lock:
            self._apply_status((plural, namespace, name), status)

    def patch_status(
        self, plural: str, name: str, patch: dict[str, Any], namespace: str = "default"
    ) -> dict[str, Any]:
        """Merge-patch the status of an existing object; returns the new status."""
        with self._lock:
            key = (plural, namespace, name)
            if key not in self._objects:
                raise self._not_found(plural, name)
            status = merge_patch(self._objects[key].get("status") or {}, patch)
            self._apply_status(key, status)
            return copy.deepcopy(status)

    def _apply_status(self, key: Key, status: dict[str, Any]) -> None:
        """Set a status, checked against the schema too: a scripted status must be one the
        real controller could write, or the test proves nothing about reading it."""
        if key not in self._objects:
            raise self._not_found(key[0], key[2])
        old = self._objects[key]
        obj = copy.deepcopy(old)
        obj["status"] = copy.deepcopy(status)
        if key[0] == "pods" and "qosClass" in (old.get("status") or {}):  # immutable (qos.py)
            obj["status"].setdefault("qosClass", old["status"]["qosClass"])
        self.errors += [f"{key[0]}/{key[2]} status: {e}" for e in self.validate(key[0], obj)]
        self._store(key, obj, "MODIFIED", old)

    def script_status(
        self,
        plural: str,
        name: str,
        statuses: list[dict[str, Any]],
        namespace: str = "default",
    ) -> None:
        """Statuses the object takes one by one, each on a GET of it (or a watch tick, see
        the module docstring); the last one stays.

        The script may be set before the object exists (the code under test creates it).
        """
        with self._lock:
            self._scripts[(plural, namespace, name)] = [copy.deepcopy(s) for s in statuses]

    def _step_script(self, key: Key) -> None:
        script = self._scripts.get(key)
        if not script or key not in self._objects:
            return
        status = script.pop(0) if len(script) > 1 else script[0]
        if self._objects[key].get("status") != status:
            self._apply_status(key, status)

    def on_create(self, plural: str, callback: OnCreate) -> None:
        """Call `callback(fake, obj)` after each create of `plural` (e.g. to add its pods)."""
        with self._lock:
            self._on_create.setdefault(plural, []).append(callback)

    def on_admit(self, plural: str, mutate: Mutate) -> None:
        """A mutating admission webhook on CREATE of `plural` (Katib's pod webhook): called
        with the body before validation and defaulting, as the API server runs mutating
        admission before its create strategy; it returns the body to store."""
        with self._lock:
            self._mutators.setdefault(plural, []).append(mutate)

    def on_validate(self, plural: str, check: Validate) -> None:
        """A validating admission webhook on CREATE and UPDATE of `plural` (Katib's
        experiment validator): called after the schema check, as the API server runs
        validating admission after the create or update strategy's validation, with the
        stored object on UPDATE; it raises ApiError to refuse the request."""
        with self._lock:
            self._validators_hooks.setdefault(plural, []).append(check)

    def on_delete(self, plural: str, callback: OnDelete) -> None:
        """Call `callback(fake, obj)` after each delete of `plural` (cascaded ones too)."""
        with self._lock:
            self._on_delete.setdefault(plural, []).append(callback)

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(event)` for every change, under the fake's lock: it must only
        queue the event (the sim's controllers are informers fed this way)."""
        with self._lock:
            self._listeners.append(listener)

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
        phase: str | None = None,
        *,
        owner: dict[str, Any] | None = None,
        spec: dict[str, Any] | None = None,
        exit_code: int | None = None,
    ) -> dict[str, Any]:
        """Store a pod (as a controller creates one), with a status for `phase`.

        phase None keeps the original meaning of this call: a pod given a `log` has finished
        (Succeeded), one without is Pending. `owner` is the owning object (an
        ownerReference to it is added, controller: true) or an ownerReference itself.
        `spec` defaults to one container named `main`.
        """
        if phase is None:
            phase = "Succeeded" if log else "Pending"
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": copy.deepcopy(spec)
            if spec is not None
            else {"containers": [{"name": "main", "image": "fake"}]},
        }
        if owner is not None:
            ref = owner if "uid" in owner else owner_reference(owner)
            pod["metadata"]["ownerReferences"] = [copy.deepcopy(ref)]
        pod["status"] = pod_status(pod, phase, exit_code)
        with self._lock:
            self._logs[(namespace, name)] = log
            key = ("pods", namespace, name)
            old = self._objects.get(key)
            self._store(key, self._stamp(pod, namespace, old), "MODIFIED" if old else "ADDED", old)
            return copy.deepcopy(self._objects[key])

    def set_pod_phase(
        self,
        namespace: str,
        name: str,
        phase: str,
        exit_code: int | None = None,
        *,
        reason: str | None = None,
        message: str | None = None,
        conditions: list[dict[str, Any]] | None = None,
    ) -> None:
        """Move a pod to `phase` with the status the kubelet writes for it (container
        states, exitCode when it terminated, Ready); `reason`/`message` go on the pod status
        (and on a waiting container for Pending)."""
        with self._lock:
            key = ("pods", namespace, name)
            if key not in self._objects:
                raise self._not_found("pods", name)
            pod = self._objects[key]
            status = pod_status(pod, phase, exit_code, reason=reason, message=message)
            if conditions is not None:
                status["conditions"] = conditions
            self._apply_status(key, status)

    def append_log(self, namespace: str, name: str, text: str) -> None:
        """Add to a pod's log (followers see it at once)."""
        with self._cond:
            self._logs[(namespace, name)] = self._logs.get((namespace, name), "") + text
            self._cond.notify_all()

    def pod_log(self, namespace: str, name: str) -> str:
        with self._lock:
            return self._logs.get((namespace, name), "")

    def put_object(self, plural: str, obj: dict[str, Any]) -> None:
        """Store an object as a controller would create it (no validation), e.g. Trials."""
        meta = obj["metadata"]
        ns = meta.get("namespace", "default")
        with self._lock:
            key = (plural, ns, meta["name"])
            old = self._objects.get(key)
            stamped = self._stamp(copy.deepcopy(obj), ns, old)
            self._store(key, stamped, "MODIFIED" if old else "ADDED", old)

    def create_object(
        self, plural: str, body: dict[str, Any], namespace: str = "default"
    ) -> dict[str, Any]:
        """Create as a POST does (validated, on_create called); ApiError when refused."""
        kind = RESOURCES[plural]
        if plural in CLUSTER_SCOPED:
            namespace = ""
        with self._lock:
            return self._create(plural, kind, namespace, copy.deepcopy(body))

    def delete_object(
        self,
        plural: str,
        name: str,
        namespace: str = "default",
        propagation: str = "Background",
    ) -> dict[str, Any]:
        """Delete as a DELETE does, with the garbage collector's cascade; ApiError if absent."""
        if plural in CLUSTER_SCOPED:
            namespace = ""
        with self._lock:
            return self._delete((plural, namespace, name), propagation)

    def get_object(
        self, plural: str, name: str, namespace: str = "default"
    ) -> dict[str, Any] | None:
        if plural in CLUSTER_SCOPED:
            namespace = ""
        with self._lock:
            obj = self._objects.get((plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list_objects(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """The stored objects of `plural` (in `namespace`, or all), by namespace and name."""
        with self._lock:
            return [
                copy.deepcopy(o)
                for (p, n, _), o in sorted(self._objects.items())
                if p == plural and namespace in (None, n)
            ]

    def created(self, plural: str) -> list[dict[str, Any]]:
        """Bodies POSTed for `plural`, as sent (valid or not)."""
        out = []
        for r in self.requests:
            route = parse_route(r.path)
            if r.method == "POST" and route and route.plural == plural and not route.name:
                out.append(r.body)
        return out

    def validate(self, plural: str, body: dict[str, Any]) -> list[str]:
        """Errors of `body` against the schema of `plural` (empty when valid)."""
        check = self._validators.get(plural)
        return check(body) if check else []

    def history(self, plural: str | None = None) -> list[Event]:
        """The retained watch events (of `plural`, or all), oldest first."""
        with self._lock:
            return [copy.deepcopy(e) for e in self._history if plural in (None, e.plural)]

    def drop_watches(self, clean: bool = False) -> None:
        """End every open watch and log stream: abruptly (the connection drops mid-stream,
        as when the API server restarts), or `clean` (the terminating chunk, as when the
        server's watch timeout passes)."""
        with self._cond:
            self._epoch += 1
            self._drop_clean = clean
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Serve no request while inside: the changes made here land as one step (a client
        that reconnects meanwhile is answered after all of them)."""
        with self._cond:
            yield

    def compact(self) -> None:
        """Forget the watch history, as etcd compaction does: a watch from any
        resourceVersion before now gets 410 Expired."""
        with self._cond:
            self._history.clear()
            self._oldest_rv = self._rv
            self._cond.notify_all()

    # ------------------------------------------------------------ storage and events

    def _bump(self) -> int:
        self._rv += 1
        return self._rv

    def _store(self, key: Key, obj: dict[str, Any], kind: str, old: dict[str, Any] | None) -> None:
        rv = self._bump()
        obj["metadata"]["resourceVersion"] = str(rv)
        if kind == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        before = copy.deepcopy(old) if old else None
        event = Event(rv, kind, key[0], key[1], key[2], copy.deepcopy(obj), before)
        self._history.append(event)
        while len(self._history) > self._history_max:
            self._oldest_rv = self._history.popleft().rv
        self._cond.notify_all()
        for listener in list(self._listeners):
            listener(event)

    def _stamp(
        self, obj: dict[str, Any], ns: str, old: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if ns:
            meta["namespace"] = ns
        else:  # a cluster-scoped object (rest.BeforeCreate clears the namespace)
            meta.pop("namespace", None)
        prior = (old or {}).get("metadata") or {}
        meta.setdefault("uid", prior.get("uid") or str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", prior.get("creationTimestamp") or _now())
        if obj.get("kind") != "Pod":
            meta.setdefault("generation", prior.get("generation") or 1)
        return obj

    def _not_found(self, plural: str, name: str) -> ApiError:
        kind = RESOURCES.get(plural)
        qualified = f"{plural}.{kind.group}" if kind and kind.group else plural
        return ApiError(
            404,
            status_body(
                404,
                "NotFound",
                f'{qualified} "{name}" not found',
                name=name,
                group=kind.group if kind else "",
                kind=plural,
            ),
        )

    def _advance_scripts(self, spec: _WatchSpec) -> None:
        for key in list(self._scripts):
            obj = self._objects.get(key)
            if obj is not None and key[0] == spec.plural and self._matches(spec, obj):
                self._step_script(key)

    # ------------------------------------------------------------ request handling

    def handle(
        self, method: str, raw_path: str, body: Any, content_type: str = ""
    ) -> tuple[int, Any]:
        """Answer one request: (code, JSON body or text), or (200, Stream)."""
        parts = urlsplit(raw_path)
        query = parse_qs(parts.query)
        with self._lock:
            self.requests.append(Recorded(method, parts.path, query, copy.deepcopy(body)))
            for i, (verb, part, code) in enumerate(self._failures):
                if verb == method and part in parts.path:
                    del self._failures[i]
                    return code, status_body(code, "InternalError", "injected by the test")
        try:
            route = parse_route(parts.path)
            if route is None:
                raise ApiError(404, status_body(404, "NotFound", f"no route for {parts.path}"))
            self._authorize(method, parts.path, query, route)
            return self._serve(method, route, query, body, content_type)
        except ApiError as reply:
            return reply.code, reply.body

    def _authorize(self, method: str, path: str, query: dict[str, list[str]], r: Route) -> None:
        if self.role is None:
            return
        attrs = Attributes(
            verb_of(method, bool(r.name), query), r.group, r.plural, r.sub, r.namespace, r.name
        )
        if self.role.allows(attrs):
            return
        message = self.role.forbidden_message(attrs)
        with self._lock:
            self.forbidden.append(Denied(method, path, attrs, message))
        raise ApiError(403, status_forbidden(attrs, message))

    def _serve(
        self, method: str, r: Route, query: dict[str, list[str]], body: Any, content_type: str = ""
    ) -> tuple[int, Any]:
        if r.group == "" and r.plural in CORE_STORES:
            return self._serve_store(method, r, query)
        kind = RESOURCES.get(r.plural)
        if kind is None or (kind.group, kind.version) != (r.group, r.version):
            raise _no_resource()
        if r.plural in CLUSTER_SCOPED and r.namespace:
            raise _no_resource()  # a cluster-scoped kind has no namespaced path
        if r.sub and r.sub not in SUBRESOURCES.get(r.plural, DEFAULT_SUBRESOURCES):
            raise _no_resource()
        watching = (query.get("watch") or [""])[0].lower() in ("true", "1")
        if not r.name:
            if method == "GET":
                spec = self._watch_spec(r.plural, r.namespace, query)
                if watching:
                    return 200, self._watch(kind, spec, query)
                return 200, self._list(kind, spec)
            if method == "POST":
                if not r.namespace and r.plural not in CLUSTER_SCOPED:
                    raise ApiError(405, status_body(405, "MethodNotAllowed", "no namespace"))
                with self._lock:
                    return 201, self._create(r.plural, kind, r.namespace, body)
            if method == "DELETE":
                spec = self._watch_spec(r.plural, r.namespace, query)
                return 200, self._delete_collection(kind, spec, _propagation(body, query))
            raise ApiError(405, status_body(405, "MethodNotAllowed", method))
        if not r.namespace and r.plural not in CLUSTER_SCOPED:
            raise _no_resource()
        key = (r.plural, r.namespace, r.name)
        if method == "GET" and watching:
            spec = self._watch_spec(r.plural, r.namespace, query)
            spec.fields.append(("metadata.name", "=", r.name))
            return 200, self._watch(kind, spec, query)
        if method == "GET" and r.sub == "log":
            return 200, self._log(r.namespace, r.name, query)
        propagation = _propagation(body, query) if method == "DELETE" else ""
        if method == "PATCH":  # PatchResource checks the media type before it reads anything
            refused = unsupported_patch(content_type, builtin=not r.group)
            if refused is not None:
                raise refused
            if body is NOT_JSON:
                raise ApiError(400, status_body(400, "BadRequest", "the body is not JSON"))
        with self._lock:
            current = self._objects.get(key)
            if current is None:
                raise self._not_found(r.plural, r.name)
            if method == "GET":
                self._step_script(key)
                return 200, copy.deepcopy(self._objects[key])
            if method == "DELETE":
                return 200, self._delete(key, propagation)
            if method in ("PUT", "PATCH"):
                if method == "PATCH":
                    body = merge_patch(copy.deepcopy(current), body)
                if r.sub == "status":
                    return 200, self._replace_status(key, kind, current, body)
                return 200, self._replace(key, kind, current, body)
        raise ApiError(405, status_body(405, "MethodNotAllowed", method))

    def _serve_store(self, method: str, r: Route, query: dict[str, list[str]]) -> tuple[int, Any]:
        """ConfigMaps and Secrets: get and list, from the dicts; a missing one is 404
        NotFound (`configmaps "kfp-launcher" not found`), which is all the KFP driver
        tolerates (backend/src/v2/config/env.go `FromConfigMap`)."""
        if r.sub:
            raise _no_resource()
        if method != "GET" or (query.get("watch") or [""])[0].lower() in ("true", "1"):
            raise ApiError(
                405,
                status_body(
                    405,
                    "MethodNotAllowed",
                    f"the fake serves {r.plural} read-only (get, list): a test puts them in "
                    f"SimCluster.{'secrets' if r.plural == 'secrets' else 'config_maps'}",
                ),
            )
        store = self.secrets if r.plural == "secrets" else self.config_maps
        with self._lock:
            if r.name:
                if not r.namespace:
                    raise _no_resource()
                data = store.get((r.namespace, r.name))
                if data is None:
                    raise self._not_found(r.plural, r.name)
                return 200, self._core_object(r.plural, r.namespace, r.name, data)
            items = [
                self._core_object(r.plural, ns, name, data)
                for (ns, name), data in sorted(store.items())
                if r.namespace in ("", ns)
            ]
            kind = CORE_STORES[r.plural]
            return 200, {
                "apiVersion": "v1",
                "kind": f"{kind}List",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }

    def _core_object(self, plural: str, ns: str, name: str, data: dict[str, str]) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": CORE_STORES[plural],
            "metadata": {"name": name, "namespace": ns, "resourceVersion": str(self._rv)},
        }
        if plural == "secrets":  # Secret.data is base64, as the API server returns it
            obj["type"] = "Opaque"
            obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        else:
            obj["data"] = dict(data)
        return obj

    # --------------------------------------------------------------- reads

    def _watch_spec(self, plural: str, ns: str, query: dict[str, list[str]]) -> _WatchSpec:
        labels = (query.get("labelSelector") or [""])[0]
        try:
            selector_matches(labels, {})
        except ValueError as e:
            raise ApiError(400, status_body(400, "BadRequest", str(e))) from None
        spec = _WatchSpec(plural, ns, labels)
        allowed = _POD_FIELDS if plural == "pods" else _FIELDS
        for term in _split_terms((query.get("fieldSelector") or [""])[0]):
            m = re.fullmatch(r"([^=!]+)(!=|==|=)(.*)", term)
            if not m:
                raise ApiError(400, status_body(400, "BadRequest", f"invalid selector: {term!r}"))
            key, op, value = m[1].strip(), m[2], m[3].strip()
            if key not in allowed:
                raise ApiError(
                    400, status_body(400, "BadRequest", f'field label not supported: "{key}"')
                )
            spec.fields.append((key, "!=" if op == "!=" else "=", value))
        return spec

    def _matches(self, spec: _WatchSpec, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        if spec.namespace and meta.get("namespace") != spec.namespace:
            return False
        if not selector_matches(spec.labels, meta.get("labels") or {}):
            return False
        getters = _POD_FIELDS if spec.plural == "pods" else _FIELDS
        return all((getters[k](obj) == value) == (op == "=") for k, op, value in spec.fields)

    def _list(self, kind: Kind, spec: _WatchSpec) -> dict[str, Any]:
        with self._lock:
            items = [
                copy.deepcopy(o)
                for (p, _, _), o in sorted(self._objects.items())
                if p == spec.plural and self._matches(spec, o)
            ]
            return {
                "apiVersion": kind.api_version,
                "kind": f"{kind.kind}List",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }

    def _watch(self, kind: Kind, spec: _WatchSpec, query: dict[str, list[str]]) -> Stream:
        rv_param = (query.get("resourceVersion") or [""])[0]
        timeout = (query.get("timeoutSeconds") or [""])[0]
        bookmarks = (query.get("allowWatchBookmarks") or [""])[0].lower() in ("true", "1")
        try:
            since = int(rv_param) if rv_param not in ("", "0") else None
            deadline = time.monotonic() + int(timeout) if timeout else None
        except ValueError:
            raise ApiError(
                400, status_body(400, "BadRequest", f"invalid value: {rv_param!r} / {timeout!r}")
            ) from None
        with self._lock:
            epoch = self._epoch
            initial: list[dict[str, Any]] = []
            if since is None:
                # "Get State and Start at Most Recent": synthetic ADDED for what exists.
                initial = [
                    {"type": "ADDED", "object": copy.deepcopy(o)}
                    for (p, _, _), o in sorted(self._objects.items())
                    if p == spec.plural and self._matches(spec, o)
                ]
                since = self._rv
            elif since < self._oldest_rv:
                gone = self._expired(since)
                return Stream("application/json", iter([_line(gone)]))
        stream = Stream("application/json")
        stream.chunks = self._watch_stream(
            stream, kind, spec, since, initial, epoch, deadline, bookmarks
        )
        return stream

    def _expired(self, since: int) -> dict[str, Any]:
        return {
            "type": "ERROR",
            "object": status_body(
                410, "Expired", f"too old resource version: {since} ({self._oldest_rv})"
            ),
        }

    def _convert(self, spec: _WatchSpec, e: Event) -> dict[str, Any] | None:
        """cache_watcher.go convertToWatchEvent: selector transitions become ADDED/DELETED."""
        if e.plural != spec.plural:
            return None
        now = self._matches(spec, e.obj)
        if e.type == "DELETED":
            return {"type": "DELETED", "object": e.obj} if now else None
        before = e.old is not None and self._matches(spec, e.old)
        if now:
            return {"type": "MODIFIED" if before else "ADDED", "object": e.obj}
        if before:
            assert e.old is not None
            old = copy.deepcopy(e.old)
            old["metadata"]["resourceVersion"] = str(e.rv)
            return {"type": "DELETED", "object": old}
        return None

    def _watch_stream(
        self,
        stream: Stream,
        kind: Kind,
        spec: _WatchSpec,
        since: int,
        initial: list[dict[str, Any]],
        epoch: int,
        deadline: float | None,
        bookmarks: bool,
    ) -> Iterator[bytes]:
        for event in initial:
            yield _line(event)
        last = since
        quiet_since = time.monotonic()
        while True:
            out: list[dict[str, Any]] = []
            with self._cond:
                while True:
                    if self._closing:
                        return
                    if epoch != self._epoch:
                        if not self._drop_clean:
                            yield ABORT
                        return
                    if last < self._oldest_rv:  # events it has not seen left the history
                        yield _line(self._expired(last))
                        return
                    fresh = [e for e in self._history if e.rv > last]
                    if fresh:
                        last = fresh[-1].rv
                        out = [c for e in fresh if (c := self._convert(spec, e))]
                        break
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        return
                    if bookmarks and now - quiet_since >= self.bookmark_s:
                        quiet_since = now
                        out = [
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": kind.kind,
                                    "apiVersion": kind.api_version,
                                    "metadata": {"resourceVersion": str(self._rv)},
                                },
                            }
                        ]
                        break
                    wait = self.script_step_s
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    if not self._cond.wait(wait):
                        if stream.client_gone():
                            return
                        self._advance_scripts(spec)
            if out:
                quiet_since = time.monotonic()
            for event in out:
                yield _line(event)

    def _log(self, ns: str, name: str, query: dict[str, list[str]]) -> Any:
        """pods/log: the text; with follow, a stream that ends when the container has
        terminated or the pod is gone (the kubelet closes it)."""
        follow = (query.get("follow") or [""])[0].lower() in ("true", "1")
        tail = (query.get("tailLines") or [""])[0]
        container = (query.get("container") or [""])[0]
        if tail:
            try:
                n = int(tail)
            except ValueError:
                raise ApiError(400, status_body(400, "BadRequest", "tailLines")) from None
            if n < 0:  # ValidatePodLogOptions
                message = f'PodLogOptions "{name}" is invalid: tailLines: Invalid value: {n}: '
                raise ApiError(
                    422,
                    status_body(422, "Invalid", message + "must be greater than or equal to 0"),
                )
        with self._lock:
            pod = self._objects.get(("pods", ns, name))
            if pod is None:
                raise self._not_found("pods", name)
            names = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
            if container and container not in names:
                raise ApiError(
                    400,
                    status_body(
                        400, "BadRequest", f"container {container} is not valid for pod {name}"
                    ),
                )
            if not container and len(names) > 1:
                raise ApiError(
                    400,
                    status_body(
                        400,
                        "BadRequest",
                        f"a container name must be specified for pod {name}, "
                        f"choose one of: [{' '.join(names)}]",
                    ),
                )
            container = container or (names[0] if names else "")
            status = pod.get("status") or {}
            if status.get("phase", "Pending") == "Pending":
                waiting = "ContainerCreating"
                for cs in status.get("containerStatuses") or []:
                    if cs.get("name") == container and "waiting" in (cs.get("state") or {}):
                        waiting = cs["state"]["waiting"].get("reason", waiting)
                raise ApiError(
                    400,
                    status_body(
                        400,
                        "BadRequest",
                        f'container "{container}" in pod "{name}" is waiting to start: {waiting}',
                    ),
                )
            text = self._logs.get((ns, name), "")
            start = 0
            if tail:
                start = tail_line_start(text, n := int(tail))
                if not follow:  # ReadLogs' limited mode: at most n lines from there
                    return "".join(_LOG_LINE.findall(text[start:])[:n])
            if not follow:
                return text[start:]
            epoch = self._epoch
        stream = Stream("text/plain")
        stream.chunks = self._follow(stream, ns, name, start, epoch)
        return stream

    def _follow(self, stream: Stream, ns: str, name: str, sent: int, epoch: int) -> Iterator[bytes]:
        while True:
            with self._cond:
                while True:
                    if self._closing:
                        return
                    if epoch != self._epoch:
                        if not self._drop_clean:
                            yield ABORT
                        return
                    text = self._logs.get((ns, name), "")
                    pod = self._objects.get(("pods", ns, name))
                    done = pod is None or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES
                    if len(text) > sent or done:
                        break
                    if not self._cond.wait(0.5) and stream.client_gone():
                        return
                chunk, sent = text[sent:], len(text)
            if chunk:
                yield chunk.encode()
            if done:
                return

    # --------------------------------------------------------------- writes

    def _check(self, plural: str, kind: Kind, ns: str, body: Any) -> None:
        if not isinstance(body, dict):
            raise ApiError(400, status_body(400, "BadRequest", "the body is not a JSON object"))
        errors = []
        if body.get("apiVersion") != kind.api_version:
            errors.append(f"apiVersion: expected {kind.api_version}")
        if body.get("kind") != kind.kind:
            errors.append(f"kind: expected {kind.kind}")
        body_ns = (body.get("metadata") or {}).get("namespace")
        if plural in CLUSTER_SCOPED:
            body_ns = None  # rest.BeforeCreate clears it for a cluster-scoped kind
        if body_ns not in (None, "", ns):  # rest.BeforeCreate / BeforeUpdate
            message = (
                "the namespace of the provided object does not match the namespace sent on "
                f"the request ({body_ns} != {ns})"
            )
            self.errors.append(f"{plural}: {message}")
            raise ApiError(400, status_body(400, "BadRequest", message))
        errors += self.validate(plural, body)
        if errors:
            name = (body.get("metadata") or {}).get("name", "")
            self.errors += [f"{plural}/{name}: {e}" for e in errors]
            what = f"{kind.kind}.{kind.group}" if kind.group else kind.kind
            raise ApiError(
                422,
                status_body(
                    422,
                    "Invalid",
                    f'{what} "{name}" is invalid: ' + "; ".join(errors),
                    name=name,
                    kind=kind.kind,
                    causes=[
                        {"reason": "FieldValueInvalid", "field": e.split(":", 1)[0], "message": e}
                        for e in errors
                    ],
                ),
            )

    def _create(self, plural: str, kind: Kind, ns: str, body: Any) -> dict[str, Any]:
        meta = body.get("metadata") if isinstance(body, dict) else None
        if isinstance(meta, dict) and not meta.get("name") and meta.get("generateName"):
            # names.SimpleNameGenerator: the prefix and 5 random [a-z0-9] (bcdf... in truth)
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            meta["name"] = meta["generateName"] + suffix
        for mutate in list(self._mutators.get(plural, [])):
            body = mutate(self, body, ns)
        self._check(plural, kind, ns, body)
        for check in list(self._validators_hooks.get(plural, [])):
            check(self, copy.deepcopy(body), None, ns)
        name = body["metadata"]["name"]
        key = (plural, ns, name)
        if key in self._objects:
            qualified = f"{plural}.{kind.group}" if kind.group else plural
            raise ApiError(
                409,
                status_body(
                    409, "AlreadyExists", f'{qualified} "{name}" already exists', name=name
                ),
            )
        obj = copy.deepcopy(body)
        for field_name in ("uid", "creationTimestamp", "resourceVersion", "deletionTimestamp"):
            obj["metadata"].pop(field_name, None)  # the server sets these, never the client
        obj = self._stamp(obj, ns)
        if plural != "pods":
            obj.pop("status", None)  # status is the controller's (a subresource)
        else:  # pod strategy PrepareForCreate (see qos.py)
            obj["status"] = {"phase": "Pending", "qosClass": pod_qos(obj)}
        self._store(key, obj, "ADDED", None)
        for callback in list(self._on_create.get(plural, [])):
            callback(self, copy.deepcopy(obj))
        return copy.deepcopy(self._objects.get(key, obj))

    def _replace(self, key: Key, kind: Kind, current: dict[str, Any], body: Any) -> dict[str, Any]:
        plural, ns, name = key
        self._check(plural, kind, ns, body)
        sent_version = (body.get("metadata") or {}).get("resourceVersion")
        if sent_version not in (None, current["metadata"]["resourceVersion"]):
            qualified = f"{plural}.{kind.group}" if kind.group else plural
            raise ApiError(
                409,
                status_body(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {qualified} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                ),
            )
        for check in list(self._validators_hooks.get(plural, [])):
            check(self, copy.deepcopy(body), copy.deepcopy(current), ns)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        for name_ in ("uid", "creationTimestamp", "generation"):
            if name_ in current["metadata"]:
                meta[name_] = current["metadata"][name_]
        if obj.get("spec") != current.get("spec") and "generation" in meta:
            meta["generation"] = current["metadata"]["generation"] + 1
        obj["status"] = copy.deepcopy(current.get("status"))  # PUT on the resource keeps status
        if obj["status"] is None:
            del obj["status"]
        self._store(key, self._stamp(obj, ns, current), "MODIFIED", current)
        return copy.deepcopy(self._objects[key])

    def _replace_status(
        self, key: Key, kind: Kind, current: dict[str, Any], body: Any
    ) -> dict[str, Any]:
        """PUT/PATCH .../status: only the status changes (the rest of the body is ignored)."""
        if not isinstance(body, dict):
            raise ApiError(400, status_body(400, "BadRequest", "the body is not a JSON object"))
        sent_version = (body.get("metadata") or {}).get("resourceVersion")
        if sent_version not in (None, current["metadata"]["resourceVersion"]):
            raise ApiError(409, status_body(409, "Conflict", "the object has been modified"))
        self._apply_status(key, body.get("status") or {})
        return copy.deepcopy(self._objects[key])

    def _dependents(self, uid: str) -> list[Key]:
        return [
            k
            for k, o in sorted(self._objects.items())
            if any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
        ]

    def _delete(self, key: Key, propagation: str) -> dict[str, Any]:
        """Delete one object; the garbage collector (pkg/controller/garbagecollector) then
        deletes what it owned (Background, the default for pods and v1 CRDs; Foreground:
        dependents first) or strips the ownerReference (Orphan)."""
        current = self._objects.get(key)
        if current is None:
            raise self._not_found(key[0], key[2])
        if propagation not in ("Background", "Foreground", "Orphan"):
            raise ApiError(
                400,
                status_body(400, "BadRequest", f"unsupported propagationPolicy {propagation!r}"),
            )
        uid = current["metadata"]["uid"]
        if propagation == "Foreground":
            marked = copy.deepcopy(current)
            marked["metadata"]["deletionTimestamp"] = _now()
            marked["metadata"].setdefault("finalizers", []).append("foregroundDeletion")
            self._store(key, marked, "MODIFIED", current)
            for dep in self._dependents(uid):
                if dep in self._objects:
                    self._delete(dep, "Foreground")
            current = self._objects[key]
        if propagation == "Orphan":
            for dep in self._dependents(uid):
                old = self._objects[dep]
                obj = copy.deepcopy(old)
                refs = [r for r in obj["metadata"]["ownerReferences"] if r.get("uid") != uid]
                obj["metadata"]["ownerReferences"] = refs
                self._store(dep, obj, "MODIFIED", old)
        gone = copy.deepcopy(current)
        self._store(key, gone, "DELETED", current)
        self.deleted.append(key)
        self._scripts.pop(key, None)
        for callback in list(self._on_delete.get(key[0], [])):
            callback(self, copy.deepcopy(gone))
        if propagation == "Background":
            for dep in self._dependents(uid):
                if dep in self._objects:
                    self._delete(dep, "Background")
        return copy.deepcopy(gone)

    def _delete_collection(self, kind: Kind, spec: _WatchSpec, propagation: str) -> dict[str, Any]:
        with self._lock:
            keys = [
                k
                for k, o in sorted(self._objects.items())
                if k[0] == spec.plural and self._matches(spec, o)
            ]
            items = [self._delete(k, propagation) for k in keys if k in self._objects]
            return {
                "apiVersion": kind.api_version,
                "kind": f"{kind.kind}List",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }


def _no_resource() -> ApiError:
    return ApiError(
        404, status_body(404, "NotFound", "the server could not find the requested resource")
    )


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


PROPAGATION_POLICIES = ("Foreground", "Background", "Orphan")


def _propagation(body: Any, query: dict[str, list[str]]) -> str:
    """DeleteOptions.propagationPolicy from the body or the query (default Background),
    validated as the delete handler does before it looks the object up
    (ValidateDeleteOptions: 422 DeleteOptions.meta.k8s.io "" is invalid)."""
    options = dict(body) if isinstance(body, dict) else {}
    for key in ("propagationPolicy", "orphanDependents"):
        if key not in options and key in query:
            value: Any = query[key][0]
            options[key] = value.lower() == "true" if key == "orphanDependents" else value
    policy, orphan = options.get("propagationPolicy"), options.get("orphanDependents")
    errors = []
    if orphan is not None and policy is not None:
        errors.append(
            f'propagationPolicy: Invalid value: "{policy}": orphanDependents and '
            "deletionPropagation cannot be both set"
        )
    if policy is not None and policy not in PROPAGATION_POLICIES:
        errors.append(
            f'propagationPolicy: Unsupported value: "{policy}": supported values: '
            '"Foreground", "Background", "Orphan", "nil"'
        )
    if errors:
        why = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
        raise ApiError(
            422,
            status_body(
                422,
                "Invalid",
                f'DeleteOptions.meta.k8s.io "" is invalid: {why}',
                name="",
                group="meta.k8s.io",
                kind="DeleteOptions",
            ),
        )
    if policy is not None:
        return str(policy)
    return "Orphan" if orphan is True else "Background"


def parse_route(path: str) -> Route | None:
    """The resource a path names, or None for a path that names none."""
    if m := _CUSTOM.match(path):
        return Route(
            m["group"], m["version"], m["ns"] or "", m["plural"], m["name"] or "", m["sub"] or ""
        )
    if m := _CORE.match(path):
        return Route("", "v1", m["ns"] or "", m["plural"], m["name"] or "", m["sub"] or "")
    return None


def pod_status(
    pod: dict[str, Any],
    phase: str,
    exit_code: int | None = None,
    *,
    reason: str | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    """The status the kubelet writes for a pod in `phase` (one state per container)."""
    now = _now()
    prior = pod.get("status") or {}
    started = prior.get("startTime") or now
    containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}
    status: dict[str, Any] = {"phase": phase, "conditions": [scheduled]}
    if phase == "Pending":
        waiting = {"reason": reason or "ContainerCreating"}
        if message:
            waiting["message"] = message
        state: dict[str, Any] = {"waiting": waiting}
        ready = False
    elif phase == "Running":
        status["startTime"] = started
        state = {"running": {"startedAt": started}}
        ready = True
    else:
        code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
        status["startTime"] = started
        state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": started,
                "finishedAt": now,
            }
        }
        ready = False
    status["conditions"].append(
        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now}
    )
    status["containerStatuses"] = [
        {
            "name": c,
            "ready": ready,
            "restartCount": 0,
            "image": "",
            "imageID": "",
            "started": phase == "Running",
            "state": copy.deepcopy(state),
        }
        for c in containers
    ]
    if reason and phase != "Pending":
        status["reason"] = reason
    if message and phase != "Pending":
        status["message"] = message
    return status


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeK8s

    def _serve(self) -> None:
        try:
            body = self._read_json()
        except ValueError:
            if self.command != "PATCH":
                self._send(400, status_body(400, "BadRequest", "the body is not JSON"))
                return
            body = NOT_JSON  # an apply patch is YAML: its media type decides first
        content_type = self.headers.get("Content-Type", "")
        code, out = self.fake.handle(self.command, self.path, body, content_type)
        if isinstance(out, Stream):
            self._stream(code, out)
        else:
            self._send(code, out)

    def _stream(self, code: int, stream: Stream) -> None:
        """Chunked transfer, flushed per event, so the client sees each as it happens."""
        stream.peer = self.connection
        self.send_response(code)
        self.send_header("Content-Type", stream.content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for chunk in stream.chunks:
                if chunk is ABORT:
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client went away
            self.close_connection = True
        finally:
            close = getattr(stream.chunks, "close", None)
            if close is not None:
                close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve


FakeK8s.handler = _Handler
FakeK8s.thread_name = "fake-k8s"
