"""What every Kubernetes launcher shares: run a custom object (a job) from creation to a
terminal state, through retries and stops of the pipeline step that launched it.

The Training Operator, Katib and KServe all report progress as `status.conditions`; the
launchers differ only in which condition means done and which means failed, so one
lifecycle serves them all (`KubeClient.run`):

- create the object, or, when a retried step finds it already there (HTTP 409), adopt it
  if it is still running the same spec (the `kubellm.dev/spec-hash` annotation), else
  delete it and create it again; a retried step never fails on "already exists";
- tie it to the step's pod with an ownerReference (from the downward API variables
  KUBELLM_POD_NAME/UID), so deleting a pipeline run garbage-collects its jobs;
- watch it (list, then watch from the resourceVersion, resumed after a dropped
  connection, re-listed after 410 Gone) instead of polling, printing each state change;
- stream the log of its pod(s) into the step's own stdout while it runs, and return the
  whole text (the trainer reads its metric lines from it);
- delete it when the deadline passes, or when the step is stopped (SIGTERM from Argo when
  a run is terminated; Ctrl-C), so nothing keeps running on the cluster unobserved; for a
  job that waits in a queue (suspended until Kueue admits it), the deadline starts at its
  admission, and a separate, generous bound (QUEUE_TIMEOUT_S) limits the wait;
- watch its pods, when asked, for a bound its own controller does not keep, and delete it
  when that is passed (the PyTorchJob's retries: pytorchjob.py `RetryCount`).

Every request here is one the Role in manifests/base/rbac.yaml allows: create, get, list,
watch and delete on the job kinds, get/list/watch on pods and get on pods/log (plus update,
for `create_or_replace`, on InferenceServices only).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException

from kubellm.backends.base import JobFailed, JobTimeout, Terminated, sigterm_raises
from kubellm.backends.kubernetes.pod_logs import PodLogs
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.responses import (
    TRANSIENT,
    Lister,
    api_message,
    interrupt,
    uid_of,
)

# HTTP status codes a request can survive: the API server or the network hiccuped.
# The uid/gid of the `kubellm` user in containers/*/Dockerfile. Pinning it lets the kubelet
# check runAsNonRoot, and fsGroup makes the shared workspace volume writable for it.
RUN_AS_UID = 10001

# sha256 of the canonical JSON of the object's `spec`: whether an existing object of the same
# name is the one this step would create (adopt it) or another (replace it).
SPEC_HASH_ANNOTATION = "kubellm.dev/spec-hash"
# The step pod's identity, set by the pipeline from the downward API (metadata.name/uid/
# namespace). With name and uid, every object a step creates is owned by its pod.
POD_NAME_ENV = "KUBELLM_POD_NAME"
POD_UID_ENV = "KUBELLM_POD_UID"
POD_NAMESPACE_ENV = "KUBELLM_POD_NAMESPACE"
# Where a pod finds its own namespace when POD_NAMESPACE_ENV is not set.
_SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# How a step ends when the pipeline stopped it: 128 + SIGTERM, what the shell would report.
EXIT_STOPPED = 128 + signal.SIGTERM
# Lines of the pod log quoted in a failure.
LOG_TAIL_LINES = 20
# After the job is done, how long its pods' log streams get to deliver their last lines.
LOG_DRAIN_S = 5.0
# A retried create meets an object that keeps coming back (another attempt creating it too).
_CREATE_ATTEMPTS = 4
# How long one wait in a queue may last (a job suspended until Kueue admits it, `queued` of
# `KubeClient.run`) before the step deletes the job and fails: a generous bound, since a
# shared cluster's queue can hold a job for hours; `timeout_s` starts only at admission.
QUEUE_TIMEOUT_S = 24 * 3600.0
# A monotonic time, or a callable that gives the current one (it moves at admission).
Deadline = float | Callable[[], float]


@dataclass(frozen=True)
class CustomResource:
    """Where a custom resource lives in the API (group/version/plural) and what it is called."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


@dataclass(frozen=True)
class RunOutcome:
    """A run that reached `done`: the object as last seen, and its pods' log.

    `logs` is the complete text of every pod `follow_logs` picked, one after another in the
    order they started (a restarted pod's log follows its predecessor's); empty without
    `follow_logs`. `log_error` says why the log could not be read, if it could not.
    `adopted` is True when a running object from an earlier attempt was taken over.
    """

    obj: dict[str, Any]
    logs: str = ""
    adopted: bool = False
    log_error: str | None = None


class JobStopped(SystemExit):
    """The step was stopped (SIGTERM) while it ran a job; the job has been deleted.

    A SystemExit with code 143, so it passes the `except Exception` of stage code and the
    step's process ends as a stopped one does, with this message on stderr.
    """

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_STOPPED)
        self.message = message

    def __str__(self) -> str:
        return self.message


def to_dict(model: Any) -> dict[str, Any]:
    """An OpenAPI-generated model (Training Operator, KServe, core v1) as its JSON body.

    The generated clients know the wire names (camelCase) and drop unset fields; a plain
    `vars()` would not.
    """
    out: dict[str, Any] = _SERIALIZER.sanitize_for_serialization(model)
    return out


# Serialization only: this client never talks to a server, so no configuration is loaded.
_SERIALIZER = k8s.ApiClient()


def pod_security() -> k8s.V1PodSecurityContext:
    """Non-root pods (the Pod Security "restricted" profile Kubeflow namespaces may enforce)."""
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=RUN_AS_UID,
        run_as_group=RUN_AS_UID,
        fs_group=RUN_AS_UID,
        fs_group_change_policy="OnRootMismatch",  # no recursive chown of a large volume
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def container_security(read_only_root: bool = False) -> k8s.V1SecurityContext:
    """No privilege escalation, no capabilities; optionally a read-only root filesystem."""
    return k8s.V1SecurityContext(
        allow_privilege_escalation=False,
        capabilities=k8s.V1Capabilities(drop=["ALL"]),
        read_only_root_filesystem=read_only_root or None,
    )


def load_api_client() -> k8s.ApiClient:
    """An ApiClient for the cluster we run in (a pipeline pod), else the user's kubeconfig.

    A private Configuration keeps us from changing the kubernetes package's global default,
    which other code in the same process (KFP) may rely on.
    """
    cfg = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
    except ConfigException:
        k8s_config.load_kube_config(client_configuration=cfg)
    return k8s.ApiClient(cfg)


def find_condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """The status condition of `type_`, if the controller has written one."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def condition_is_true(obj: dict[str, Any], type_: str) -> bool:
    cond = find_condition(obj, type_)
    return cond is not None and str(cond.get("status")) == "True"


def condition_text(obj: dict[str, Any], type_: str) -> str:
    """`reason: message` of a condition: what a person needs to see when a job fails."""
    cond = find_condition(obj, type_) or {}
    parts = [str(cond[k]) for k in ("reason", "message") if cond.get(k)]
    return ": ".join(parts) if parts else "no reason given"


def failed_condition(obj: dict[str, Any]) -> str | None:
    """The failure text when the `Failed` condition is True (Training Operator, Katib)."""
    return condition_text(obj, "Failed") if condition_is_true(obj, "Failed") else None


def status_summary(obj: dict[str, Any]) -> str:
    """The newest condition that holds, e.g. `Running`; `Pending` before the controller acts."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    true = [c for c in conditions if str(c.get("status")) == "True"]
    if true:
        return str(true[-1].get("type"))
    if conditions:
        last = conditions[-1]
        reason = f" ({last['reason']})" if last.get("reason") else ""
        return f"{last.get('type')}={last.get('status')}{reason}"
    return "Pending"


def spec_hash(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of `body["spec"]` (sorted keys, no whitespace)."""
    canonical = json.dumps(body.get("spec"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _own_namespace() -> str | None:
    """The step pod's namespace: KUBELLM_POD_NAMESPACE, else its service account's."""
    if ns := os.environ.get(POD_NAMESPACE_ENV):
        return ns
    try:
        with open(_SA_NAMESPACE_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None


def owner_reference(namespace: str) -> dict[str, Any] | None:
    """The step pod as the owner of an object in `namespace`, or None.

    None outside a pipeline step (KUBELLM_POD_NAME/UID unset), and when the step runs in
    another namespace: an owner is looked up in its dependent's namespace, and the garbage
    collector deletes a dependent whose owner it cannot find, which would be at once.
    Not a controller reference, and blockOwnerDeletion false: the job's own controller owns
    it, and blocking would need the `update` verb on pods/finalizers, which the Role lacks.
    """
    name, uid = os.environ.get(POD_NAME_ENV), os.environ.get(POD_UID_ENV)
    if not (name and uid):
        return None
    own = _own_namespace()
    if own is not None and own != namespace:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": name,
        "uid": uid,
        "controller": False,
        "blockOwnerDeletion": False,
    }


def prepare_body(body: dict[str, Any], namespace: str) -> dict[str, Any]:
    """A copy of `body` with the spec-hash annotation and the step pod's ownerReference.

    The labels and annotations it already has are kept.
    """
    out = json.loads(json.dumps(body))  # a deep copy that is plain JSON, as sent
    meta = out.setdefault("metadata", {})
    meta["annotations"] = {**(meta.get("annotations") or {}), SPEC_HASH_ANNOTATION: spec_hash(out)}
    owner = owner_reference(namespace)
    if owner is not None:
        refs = [r for r in meta.get("ownerReferences") or [] if r.get("uid") != owner["uid"]]
        meta["ownerReferences"] = [*refs, owner]
    return out


def _print_line(line: str) -> None:
    print(line, flush=True)


@dataclass(frozen=True)
class PodWatch:
    """Pods that `KubeClient.run` watches besides the job, and what it makes of them.

    `check(event_type, pod)` is called, on the watch's own thread, for every change of a pod
    the label `selector` picks and the job controls (the pods of a listing come as
    `LISTED`, then `ADDED`, `MODIFIED`, `DELETED`); it returns why the job must be stopped,
    or None. With a reason, the run deletes the job and raises JobFailed quoting it: a bound
    the job's own controller does not keep (the PyTorchJob retry count, pytorchjob.py).
    """

    selector: str
    check: Callable[[str, dict[str, Any]], str | None]


class _Clock:
    """The deadline of a run whose job may wait in a queue (`KubeClient.run(queued=...)`).

    `timeout_s` counts from admission: from the start for a job that is never queued, else
    from the moment it is seen admitted, and anew after each re-admission (a job pre-empted
    back into the queue), as the Training Operator's activeDeadlineSeconds does (it resets
    startTime on resume: kubeflow/training-operator pkg/controller.v1/common/job.go#L171 at
    v1.9.0). While the job waits, `queue_timeout_s` bounds that wait instead.
    """

    def __init__(self, timeout_s: float, queue_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.at = time.monotonic() + timeout_s
        self.queued_since: float | None = None
        self.waited = False  # the job has been in a queue
        self.why = ""

    def __call__(self) -> float:
        return self.at

    def observe(self, why: str | None) -> str | None:
        """The job is seen waiting in a queue (`why`) or admitted (None); the line to print
        when that changes."""
        now = time.monotonic()
        if why is not None and self.queued_since is None:
            self.queued_since, self.why, self.waited = now, why, True
            self.at = now + self.queue_timeout_s
            return (
                f"waiting in a queue ({why}); the {self.timeout_s:g}s timeout starts when it "
                f"is admitted (it may wait {self.queue_timeout_s:g}s)"
            )
        if why is None and self.queued_since is not None:
            waited, self.queued_since = now - self.queued_since, None
            self.at = now + self.timeout_s
            return f"admitted after {waited:.0f}s in the queue; {self.timeout_s:g}s from now"
        return None


class _PodWatcher:
    """Runs a PodWatch on its own thread; when its check gives a reason, stops the run's
    watch of the job (`fired`, and the job watch's open stream is cut)."""

    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        watch: PodWatch,
        owner: CustomResource,
        owner_uid: str | None,
        say: Callable[[str], None],
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.watch = watch
        self.owner_kind = owner.kind
        self.owner_uid = owner_uid
        self.say = say
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._streams: dict[str, Any] = {}  # "pods" / "job": the open watch response of each
        self._thread = threading.Thread(
            target=self._run, name=f"pods:{watch.selector}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def fired(self) -> bool:
        return self.reason is not None

    def job_watch_opened(self, resp: Any) -> None:
        self._opened("job", resp)

    def _opened(self, which: str, resp: Any) -> None:
        with self._lock:
            self._streams[which] = resp
        if self._stop.is_set():
            interrupt(resp)

    def _run(self) -> None:
        lister = Lister(self.kube.core.list_namespaced_pod, (self.namespace,))
        try:
            for event in self.kube.events(
                lister,
                {"label_selector": self.watch.selector},
                math.inf,
                stopped=self._stop.is_set,
                on_open=lambda resp: self._opened("pods", resp),
            ):
                listed = event.type == "LIST"
                for pod in event.items if listed else (event.obj,):
                    if not self._ours(pod):
                        continue
                    why = self.watch.check("LISTED" if listed else event.type, pod)
                    if why is not None:
                        self.reason = why
                        self.close()
                        return
        except Exception as e:  # the job is still watched; only this bound is lost
            self.say(f"watching pods {self.watch.selector} failed ({e}); not checked further")

    def _ours(self, pod: dict[str, Any]) -> bool:
        """False for a pod controlled by another incarnation of the job (on its way out)."""
        for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
            theirs = ref.get("controller") and ref.get("kind") == self.owner_kind
            if theirs and self.owner_uid and ref.get("uid") != self.owner_uid:
                return False
        return True

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            streams = list(self._streams.values())
        for resp in streams:
            interrupt(resp)
        if threading.current_thread() is not self._thread:
            self._thread.join(1.0)


@dataclass(frozen=True)
class _Event:
    """What `events` reports: a fresh listing (`LIST`, with `items`) or one watch event."""

    type: str
    obj: dict[str, Any] = field(default_factory=dict)
    items: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class _Verdict:
    """How waiting on an object ended."""

    outcome: Literal["done", "failed", "deleted", "replaced", "timeout", "aborted"]
    obj: dict[str, Any] | None
    state: str
    why: str = ""


class KubeClient:
    """The few API calls the launchers need, with the failure semantics of kubellm.backends.base.

    `api_client` lets tests (and callers with their own credentials) pass a configured
    client; otherwise one is loaded on first use, so constructing a launcher never needs a
    cluster.

    Nothing sleeps while a job makes progress: state changes arrive as watch events.
    `poll_interval_s` is how long one watch request stays open (the server-side
    `timeoutSeconds`, at least 1 s) before it is renewed from the last resourceVersion, and
    the longest pause between retries after an API or connection error (backoff starts at
    0.2 s and doubles). `request_timeout_s` bounds every other request.
    """

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        poll_interval_s: float = 10.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        self._api_client = api_client
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s

    @property
    def api_client(self) -> k8s.ApiClient:
        if self._api_client is None:
            self._api_client = load_api_client()
        return self._api_client

    @property
    def custom(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api_client)

    @property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api_client)

    # ------------------------------------------------------------------ single requests

    def create(self, res: CustomResource, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create the object; an API rejection becomes JobFailed with the server's message."""
        try:
            return self._create(res, namespace, body)
        except ApiException as e:
            hint = " (delete it, or pick another name)" if e.status == 409 else ""
            raise _rejected(res, namespace, body, "created", e, hint) from e

    def create_or_replace(
        self, res: CustomResource, namespace: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Create, or replace the spec of an existing object of the same name (redeploys).

        Needs the `update` verb, which the Role grants on InferenceServices only.
        """
        try:
            return self._create(res, namespace, body)
        except ApiException as e:
            if e.status != 409:
                raise _rejected(res, namespace, body, "created", e) from e
        name = body["metadata"]["name"]
        current = self.get(res, namespace, name)
        if current is None:  # deleted between our create and get: try once more
            return self.create(res, namespace, body)
        # Optimistic concurrency: the replace fails (409) if someone changed it meanwhile.
        version = current["metadata"]["resourceVersion"]
        replacement = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
        try:
            out: dict[str, Any] = self.custom.replace_namespaced_custom_object(
                res.group,
                res.version,
                namespace,
                res.plural,
                name,
                replacement,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as e:
            raise _rejected(res, namespace, body, "replaced", e) from e
        return out

    def _create(self, res: CustomResource, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.custom.create_namespaced_custom_object(
            res.group,
            res.version,
            namespace,
            res.plural,
            body,
            _request_timeout=self.request_timeout_s,
        )
        return out

    def get(self, res: CustomResource, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            out: dict[str, Any] = self.custom.get_namespaced_custom_object(
                res.group,
                res.version,
                namespace,
                res.plural,
                name,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return out

    def list(
        self, res: CustomResource, namespace: str, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        out = self.custom.list_namespaced_custom_object(
            res.group,
            res.version,
            namespace,
            res.plural,
            label_selector=label_selector,
            _request_timeout=self.request_timeout_s,
        )
        return list(out.get("items") or [])

    def delete(
        self,
        res: CustomResource,
        namespace: str,
        name: str,
        *,
        propagation: str = "Background",
        uid: str | None = None,
    ) -> bool:
        """Delete with its pods; False when it was already gone.

        `propagation` Background removes the object at once and its pods after; Foreground
        keeps it (with a deletionTimestamp) until its pods are gone. With `uid`, only that
        incarnation of the name is deleted (a 409 if the name now holds another).
        """
        try:
            self.custom.delete_namespaced_custom_object(
                res.group,
                res.version,
                namespace,
                res.plural,
                name,
                body=k8s.V1DeleteOptions(
                    propagation_policy=propagation,
                    preconditions=k8s.V1Preconditions(uid=uid) if uid else None,
                ),
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    def pod_log(
        self, namespace: str, label_selector: str, container: str | None = None
    ) -> tuple[str, str]:
        """(pod name, full log) of the pod the selector picks; prefers a finished pod.

        The log is read raw: the generated client would json-decode a log that happens to
        be valid JSON and hand back its repr.
        """
        pods = self.core.list_namespaced_pod(
            namespace, label_selector=label_selector, _request_timeout=self.request_timeout_s
        ).items
        if not pods:
            raise LookupError(f"no pod in {namespace} matches {label_selector}")
        pods.sort(key=lambda p: (getattr(p.status, "phase", "") != "Succeeded", p.metadata.name))
        pod = pods[0].metadata.name
        kwargs: dict[str, Any] = {"container": container} if container else {}
        resp = self.core.read_namespaced_pod_log(
            pod,
            namespace,
            _preload_content=False,
            _request_timeout=self.request_timeout_s,
            **kwargs,
        )
        data = resp.data
        return pod, data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)

    # ------------------------------------------------------------------ the lifecycle

    def run(
        self,
        res: CustomResource,
        namespace: str,
        body: dict[str, Any],
        *,
        timeout_s: float,
        done: Callable[[dict[str, Any]], bool],
        failure: Callable[[dict[str, Any]], str | None] = failed_condition,
        describe: Callable[[dict[str, Any]], str] = status_summary,
        follow_logs: str | None = None,
        log_container: str | None = None,
        echo: Callable[[str], None] | None = None,
        replace_terminal: bool = True,
        queued: Callable[[dict[str, Any]], str | None] | None = None,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
        pod_watch: PodWatch | None = None,
    ) -> RunOutcome:
        """Create (or adopt, or replace) the object of `body` and see it to `done`.

        - An object of the same name that is still running with the same spec (a retried
          step) is adopted and watched; one that has another spec, or has failed, is
          deleted and created again; one that finished (`done`) is too, unless
          `replace_terminal` is False, when its result is taken as it is.
        - `failure` returns the reason text of a terminal failure, or None; JobFailed then
          quotes it and the last lines of the log. `describe` gives the state printed on
          each change (`pytorchjob/NAME: Running`) and quoted in a timeout.
        - `follow_logs` is a label selector for the pod(s) whose log (container
          `log_container`, needed when a pod has several) is echoed line by line,
          prefixed with the pod name, while the job runs, and returned whole.
        - After `timeout_s` the object is deleted and JobTimeout raised. A SIGTERM (the
          pipeline was stopped) deletes it and raises JobStopped (exit code 143); Ctrl-C
          deletes it and re-raises KeyboardInterrupt.
        - `queued` says why the object waits in a queue (e.g. suspended until Kueue admits
          it), or None once it is admitted. With it, `timeout_s` starts at admission (anew
          after each re-admission) and `queue_timeout_s` bounds each wait in the queue; the
          wait and the admission are printed.
        - `pod_watch` checks the job's pods as they change (PodWatch); when it gives a
          reason, the object is deleted and JobFailed raised with it.
        - `echo` takes every line this prints (default: print to stdout, flushed).
        """
        say = echo or _print_line
        name = body["metadata"]["name"]
        ref = f"{res.kind.lower()}/{name}"
        clock = _Clock(timeout_s, queue_timeout_s)
        body = prepare_body(body, namespace)
        logs: PodLogs | None = None
        watcher: _PodWatcher | None = None
        with sigterm_raises():
            try:
                obj, adopted = self._start(
                    res, namespace, body, done, failure, describe, clock.at, say, replace_terminal
                )
                uid = (obj.get("metadata") or {}).get("uid")
                if follow_logs:
                    logs = PodLogs(self, namespace, follow_logs, log_container, say, res.kind, uid)
                    logs.start()
                if pod_watch:
                    watcher = _PodWatcher(self, namespace, pod_watch, res, uid, say)
                    watcher.start()
                verdict = self._await(
                    res,
                    namespace,
                    name,
                    clock,
                    done,
                    failure,
                    describe,
                    say,
                    uid,
                    queued=queued and (lambda o: clock.observe(queued(o))),
                    watcher=watcher,
                )
                fate = ""
                if verdict.outcome == "aborted":  # its pods go first: their logs end
                    fate = self._delete_fate(res, namespace, name)
                drain = LOG_DRAIN_S if verdict.outcome in ("done", "failed", "aborted") else 0.0
                text = logs.close(drain) if logs else ""
                if verdict.outcome == "done" and verdict.obj is not None:
                    error = logs.error(text) if logs else None
                    return RunOutcome(verdict.obj, text, adopted, error)
                tail = logs.tail(LOG_TAIL_LINES) if logs else ""
                raise self._verdict_error(res, namespace, name, clock, verdict, tail, fate)
            except Terminated:  # delete first: Argo kills the step after its grace period
                message = f"{ref} in {namespace}: the step was stopped (SIGTERM); "
                message += self._delete_for_stop(res, namespace, name)
                say(message)
                print(message, file=sys.stderr, flush=True)
                raise JobStopped(message) from None
            except KeyboardInterrupt:
                fate = self._delete_for_stop(res, namespace, name)
                say(f"{ref} in {namespace}: interrupted; {fate}")
                raise
            finally:
                if watcher:
                    watcher.close()
                if logs:
                    logs.close(0.0)  # no-op when closed above; stops the threads otherwise

    def wait(
        self,
        res: CustomResource,
        namespace: str,
        name: str,
        timeout_s: float,
        *,
        done: Callable[[dict[str, Any]], bool],
        failure: Callable[[dict[str, Any]], str | None] = failed_condition,
        describe: Callable[[dict[str, Any]], str] = status_summary,
    ) -> dict[str, Any]:
        """Watch an existing object until `done` or `failure` says so; on timeout delete it
        and raise JobTimeout. `run` without the create, the logs and the signal handling.
        """
        clock = _Clock(timeout_s, timeout_s)
        verdict = self._await(
            res, namespace, name, clock, done, failure, describe, _print_line, None
        )
        if verdict.outcome == "done" and verdict.obj is not None:
            return verdict.obj
        raise self._verdict_error(res, namespace, name, clock, verdict, "")

    def _start(
        self,
        res: CustomResource,
        namespace: str,
        body: dict[str, Any],
        done: Callable[[dict[str, Any]], bool],
        failure: Callable[[dict[str, Any]], str | None],
        describe: Callable[[dict[str, Any]], str],
        deadline: float,
        say: Callable[[str], None],
        replace_terminal: bool,
    ) -> tuple[dict[str, Any], bool]:
        """Create the object, or adopt or replace the one of that name: (object, adopted)."""
        name = body["metadata"]["name"]
        ref = f"{res.kind.lower()}/{name}"
        want = body["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
        failures = 0
        for _ in range(_CREATE_ATTEMPTS):
            while True:
                try:
                    created = self._create(res, namespace, body)
                    say(f"{ref}: created in {namespace}")
                    return created, False
                except ApiException as e:
                    if e.status in TRANSIENT and time.monotonic() < deadline:
                        failures += 1
                        self.pause(failures, deadline)
                        continue  # a create that did land comes back as 409: adopted below
                    if e.status != 409:
                        raise _rejected(res, namespace, body, "created", e) from e
                    break
            current = self.get(res, namespace, name)
            if current is None:
                continue  # deleted meanwhile: create again
            why = _replace_reason(current, want, done, failure, describe, replace_terminal)
            if why is None:
                state = describe(current)
                say(f"{ref}: adopted the one already in {namespace} ({state}, same spec)")
                return current, True
            say(f"{ref}: already in {namespace} but {why}; deleting it to create it again")
            self._delete_and_wait(res, namespace, current, deadline)
        raise JobFailed(
            f"{ref} in {namespace} was not created: it reappeared {_CREATE_ATTEMPTS} times "
            "while being replaced (is another run creating it too?)"
        )

    def _delete_and_wait(
        self, res: CustomResource, namespace: str, current: dict[str, Any], deadline: float
    ) -> None:
        """Delete `current` (foreground: its pods go first, so new pods can take their names)
        and wait until it is gone."""
        meta = current.get("metadata") or {}
        name, uid = meta["name"], meta.get("uid")
        ref = f"{res.kind.lower()}/{name}"
        if not meta.get("deletionTimestamp"):
            try:
                self.delete(res, namespace, name, propagation="Foreground", uid=uid)
            except ApiException as e:
                if e.status != 409:  # 409: the name holds another object now; look again
                    raise _rejected(res, namespace, current, "deleted", e) from e
                return
        selector = {"field_selector": f"metadata.name={name}"}
        for event in self.events(self._list_custom(res, namespace), selector, deadline):
            if event.type == "LIST":
                if not any((o.get("metadata") or {}).get("uid") == uid for o in event.items):
                    return
            elif event.type == "DELETED" or uid_of(event.obj) != uid:
                return
        raise JobTimeout(f"{ref} in {namespace} was still being deleted when the time ran out")

    def _await(
        self,
        res: CustomResource,
        namespace: str,
        name: str,
        deadline: Deadline,
        done: Callable[[dict[str, Any]], bool],
        failure: Callable[[dict[str, Any]], str | None],
        describe: Callable[[dict[str, Any]], str],
        say: Callable[[str], None],
        uid: str | None,
        *,
        queued: Callable[[dict[str, Any]], str | None] | None = None,
        watcher: _PodWatcher | None = None,
    ) -> _Verdict:
        """Watch the object until `done`, `failure`, its deletion, the deadline or the pod
        watcher's reason (`aborted`). `queued(obj)` moves the deadline and gives the line to
        print when the job enters or leaves a queue."""
        ref = f"{res.kind.lower()}/{name}"
        shown: str | None = None
        last = "never read"
        seen: dict[str, Any] | None = None
        fired = watcher.fired if watcher else lambda: False
        on_open = watcher.job_watch_opened if watcher else None
        try:
            for obj in self.watch_object(res, namespace, name, deadline, fired, on_open):
                if obj is None:
                    return _Verdict("deleted", None, last)
                if uid is not None and uid_of(obj) not in (None, uid):
                    return _Verdict("replaced", obj, last)
                uid = uid or uid_of(obj)
                seen = obj
                last = describe(obj)
                if last != shown:
                    say(f"{ref}: {last}")
                    shown = last
                if queued and (line := queued(obj)):
                    say(f"{ref}: {line}")
                if done(obj):
                    return _Verdict("done", obj, last)
                why = failure(obj)
                if why is not None:
                    return _Verdict("failed", obj, last, why)
                if fired():
                    break
        except Exception:  # the watcher cut the stream under the read: not an API error
            if not fired():
                raise
        if watcher and watcher.reason:
            return _Verdict("aborted", seen, last, watcher.reason)
        return _Verdict("timeout", None, last)

    def _verdict_error(
        self,
        res: CustomResource,
        namespace: str,
        name: str,
        clock: _Clock,
        verdict: _Verdict,
        tail: str,
        fate: str = "",
    ) -> JobFailed:
        ref = f"{res.kind.lower()}/{name}"
        if verdict.outcome == "aborted":
            fate = fate or self._delete_fate(res, namespace, name)
            return JobFailed(f"{ref} in {namespace}: {verdict.why}; {fate}{tail}")
        if verdict.outcome == "failed":
            return JobFailed(f"{ref} in {namespace} failed: {verdict.why}{tail}")
        if verdict.outcome == "deleted":
            return JobFailed(f"{ref} in {namespace} was deleted while waited on{tail}")
        if verdict.outcome == "replaced":
            return JobFailed(
                f"{ref} in {namespace} was replaced by another object of that name while "
                f"waited on (is another run using the name?){tail}"
            )
        fate = self._delete_fate(res, namespace, name)
        if clock.queued_since is not None:
            return JobTimeout(
                f"{ref} in {namespace} was not admitted within {clock.queue_timeout_s:g}s "
                f"(waiting in a queue: {clock.why}; last state: {verdict.state}); {fate}{tail}"
            )
        since = " of being admitted" if clock.waited else ""
        return JobTimeout(
            f"{ref} in {namespace} did not finish within {clock.timeout_s:g}s{since} "
            f"(last state: {verdict.state}); {fate}{tail}"
        )

    def _delete_fate(self, res: CustomResource, namespace: str, name: str) -> str:
        """Delete the object; what became of it, for the error that follows."""
        try:
            self.delete(res, namespace, name)
        except Exception as e:  # the failure is the news; say what is left behind
            return f"deleting it failed ({e}); delete it by hand"
        return "it has been deleted"

    def _delete_for_stop(self, res: CustomResource, namespace: str, name: str) -> str:
        try:
            gone = self.delete(res, namespace, name)
        except Exception as e:
            return f"deleting {res.kind.lower()}/{name} failed ({e}); delete it by hand"
        return "the job has been deleted" if gone else "the job was already gone"

    # ------------------------------------------------------------------ watching

    def watch_object(
        self,
        res: CustomResource,
        namespace: str,
        name: str,
        deadline: Deadline,
        stopped: Callable[[], bool] = lambda: False,
        on_open: Callable[[Any], None] | None = None,
    ) -> Iterator[dict[str, Any] | None]:
        """Each state of the object `name` as a watch (re-listed when it breaks) reports it,
        until the deadline or `stopped()`; None when it is deleted or missing, which ends
        the iteration. `deadline` may be a callable, read anew at every step (it moves when
        a queued job is admitted)."""
        selector = {"field_selector": f"metadata.name={name}"}
        events = self.events(
            self._list_custom(res, namespace), selector, deadline, stopped, on_open
        )
        for event in events:
            if event.type == "LIST":
                found = [o for o in event.items if (o.get("metadata") or {}).get("name") == name]
                if not found:
                    yield None
                    return
                yield found[0]
            elif event.type in ("ADDED", "MODIFIED", "DELETED"):
                if (event.obj.get("metadata") or {}).get("name") != name:
                    continue  # a server that ignores the field selector
                if event.type == "DELETED":
                    yield None
                    return
                yield event.obj

    def _list_custom(self, res: CustomResource, namespace: str) -> Lister:
        return Lister(
            self.custom.list_namespaced_custom_object,
            (res.group, res.version, namespace, res.plural),
        )

    def events(
        self,
        lister: Lister,
        selector: dict[str, str],
        deadline: Deadline,
        stopped: Callable[[], bool] = lambda: False,
        on_open: Callable[[Any], None] | None = None,
    ) -> Iterator[_Event]:
        """A listing, then every change after it, until the deadline (a monotonic time, or a
        callable giving the current one) or `stopped()`.

        The watch resumes from the last resourceVersion seen (event or bookmark) when its
        stream ends or the connection drops; after 410 Gone (that version was compacted
        away) it lists again, and the caller sees a fresh `LIST`. Transient errors (429,
        5xx, connection errors) are retried with backoff; others are raised.
        """
        due = deadline if callable(deadline) else lambda: deadline
        version: str | None = None
        failures = 0
        expired = 0  # 410s since the last event: a server that keeps answering 410 is paced
        watcher = k8s_watch.Watch()
        while not stopped():
            remaining = due() - time.monotonic()
            if remaining <= 0:
                return
            try:
                if version is None:
                    resp = lister.fn(
                        *lister.args,
                        **selector,
                        _preload_content=False,
                        _request_timeout=self.request_timeout_s,
                    )
                    listing = json.loads(resp.data)
                    version = (listing.get("metadata") or {}).get("resourceVersion") or ""
                    failures = 0
                    yield _Event("LIST", items=tuple(listing.get("items") or ()))
                    continue
                window = max(1, math.ceil(min(self.poll_interval_s, remaining)))
                # The read timeout ends a silent stream at the deadline, or a dead connection.
                read = min(window + self.request_timeout_s, remaining + 0.05)
                kwargs: dict[str, Any] = {
                    **selector,
                    "timeout_seconds": window,
                    "allow_watch_bookmarks": True,
                    "_request_timeout": (self.request_timeout_s, read),
                }
                if version:
                    kwargs["resource_version"] = version
                for raw in watcher.stream(lister.opened(on_open), *lister.args, **kwargs):
                    obj = raw.get("raw_object") or {}
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    failures = expired = 0
                    if raw.get("type") != "BOOKMARK":
                        yield _Event(str(raw.get("type")), obj)
                    if stopped() or time.monotonic() >= due():
                        return
            except ApiException as e:
                if e.status == 410:  # compacted: list again, watch from there
                    version = None
                    expired += 1
                    if expired > 1:
                        self.pause(expired - 1, due(), stopped)
                    continue
                if e.status not in TRANSIENT:
                    raise
                failures += 1
                self.pause(failures, due(), stopped)
            except (OSError, urllib3.exceptions.HTTPError, json.JSONDecodeError):
                # The connection dropped or timed out: resume from `version`.
                failures += 1
                self.pause(failures, due(), stopped)

    def pause(
        self, failures: int, deadline: float, stopped: Callable[[], bool] = lambda: False
    ) -> None:
        """Back off after the `failures`-th error in a row, never past the deadline."""
        pause = min(self.poll_interval_s, 0.2 * 2 ** min(failures - 1, 10))
        end = min(time.monotonic() + pause, deadline)
        while not stopped() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))


def _replace_reason(
    current: dict[str, Any],
    want: str,
    done: Callable[[dict[str, Any]], bool],
    failure: Callable[[dict[str, Any]], str | None],
    describe: Callable[[dict[str, Any]], str],
    replace_terminal: bool,
) -> str | None:
    """Why the existing object cannot be adopted, or None when it can."""
    meta = current.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return "it is being deleted"
    have = (meta.get("annotations") or {}).get(SPEC_HASH_ANNOTATION)
    if have != want:
        return "its spec differs" if have else "it was not created from this spec"
    why = failure(current)
    if why is not None:
        return f"it failed ({why})"
    if done(current) and replace_terminal:
        return f"it already finished ({describe(current)})"
    return None


def _rejected(
    res: CustomResource,
    namespace: str,
    body: dict[str, Any],
    verb: str,
    e: ApiException,
    hint: str = "",
) -> JobFailed:
    """JobFailed quoting the API server's Status message (it names the invalid field)."""
    name = (body.get("metadata") or {}).get("name", "?")
    return JobFailed(
        f"{res.kind.lower()}/{name} in {namespace} was not {verb}: "
        f"HTTP {e.status} {api_message(e)}{hint}"
    )


class OnCluster:
    """What every cluster backend (PyTorchJob and TrainJob trainers, the Katib tuner) holds:
    a KubeClient (`poll_interval_s` between polls, `request_timeout_s` per request) and the
    run's ClusterSettings."""

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        *,
        cluster: ClusterSettings | None = None,
        poll_interval_s: float = 10.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.kube = KubeClient(api_client, poll_interval_s, request_timeout_s)
        self.cluster = cluster or ClusterSettings()
