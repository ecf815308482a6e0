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
  a run is terminated; Ctrl-C), so nothing keeps running on the cluster unobserved.

Every request here is one the Role in manifests/base/rbac.yaml allows: create, get, list,
watch and delete on the job kinds, get/list/watch on pods and get on pods/log (plus update,
for `create_or_replace`, on InferenceServices only).
"""

from __future__ import annotations

import contextlib
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
from types import FrameType
from typing import Any, Literal

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException

from kubellm.backends.base import JobFailed, JobTimeout
from kubellm.backends.kubernetes.pod_logs import PodLogs
from kubellm.backends.kubernetes.responses import (
    TRANSIENT,
    Lister,
    api_message,
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
class _Event:
    """What `events` reports: a fresh listing (`LIST`, with `items`) or one watch event."""

    type: str
    obj: dict[str, Any] = field(default_factory=dict)
    items: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class _Verdict:
    """How waiting on an object ended."""

    outcome: Literal["done", "failed", "deleted", "replaced", "timeout"]
    obj: dict[str, Any] | None
    state: str
    why: str = ""


class _Terminated(BaseException):
    """SIGTERM arrived while `run` was active (a BaseException: no `except Exception` eats it)."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises _Terminated in the main thread; the old handler returns
    afterwards. Outside the main thread (where Python cannot handle signals) it does nothing.

    Only the first SIGTERM raises: a second one, while the job is being deleted, must not
    cut that deletion short.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


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
        - `echo` takes every line this prints (default: print to stdout, flushed).
        """
        say = echo or _print_line
        name = body["metadata"]["name"]
        ref = f"{res.kind.lower()}/{name}"
        deadline = time.monotonic() + timeout_s
        body = prepare_body(body, namespace)
        logs: PodLogs | None = None
        with _sigterm_raises():
            try:
                obj, adopted = self._start(
                    res, namespace, body, done, failure, describe, deadline, say, replace_terminal
                )
                uid = (obj.get("metadata") or {}).get("uid")
                if follow_logs:
                    logs = PodLogs(self, namespace, follow_logs, log_container, say, res, uid)
                    logs.start()
                verdict = self._await(
                    res, namespace, name, deadline, done, failure, describe, say, uid
                )
                drain = LOG_DRAIN_S if verdict.outcome in ("done", "failed") else 0.0
                text = logs.close(drain) if logs else ""
                if verdict.outcome == "done" and verdict.obj is not None:
                    error = logs.error(text) if logs else None
                    return RunOutcome(verdict.obj, text, adopted, error)
                tail = logs.tail(LOG_TAIL_LINES) if logs else ""
                raise self._verdict_error(res, namespace, name, timeout_s, verdict, tail)
            except _Terminated:  # delete first: Argo kills the step after its grace period
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
        deadline = time.monotonic() + timeout_s
        verdict = self._await(
            res, namespace, name, deadline, done, failure, describe, _print_line, None
        )
        if verdict.outcome == "done" and verdict.obj is not None:
            return verdict.obj
        raise self._verdict_error(res, namespace, name, timeout_s, verdict, "")

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
        deadline: float,
        done: Callable[[dict[str, Any]], bool],
        failure: Callable[[dict[str, Any]], str | None],
        describe: Callable[[dict[str, Any]], str],
        say: Callable[[str], None],
        uid: str | None,
    ) -> _Verdict:
        """Watch the object until `done`, `failure`, its deletion or the deadline."""
        ref = f"{res.kind.lower()}/{name}"
        shown: str | None = None
        last = "never read"
        for obj in self.watch_object(res, namespace, name, deadline):
            if obj is None:
                return _Verdict("deleted", None, last)
            if uid is not None and uid_of(obj) not in (None, uid):
                return _Verdict("replaced", obj, last)
            uid = uid or uid_of(obj)
            last = describe(obj)
            if last != shown:
                say(f"{ref}: {last}")
                shown = last
            if done(obj):
                return _Verdict("done", obj, last)
            why = failure(obj)
            if why is not None:
                return _Verdict("failed", obj, last, why)
        return _Verdict("timeout", None, last)

    def _verdict_error(
        self,
        res: CustomResource,
        namespace: str,
        name: str,
        timeout_s: float,
        verdict: _Verdict,
        tail: str,
    ) -> JobFailed:
        ref = f"{res.kind.lower()}/{name}"
        if verdict.outcome == "failed":
            return JobFailed(f"{ref} in {namespace} failed: {verdict.why}{tail}")
        if verdict.outcome == "deleted":
            return JobFailed(f"{ref} in {namespace} was deleted while waited on{tail}")
        if verdict.outcome == "replaced":
            return JobFailed(
                f"{ref} in {namespace} was replaced by another object of that name while "
                f"waited on (is another run using the name?){tail}"
            )
        try:
            self.delete(res, namespace, name)
            fate = "it has been deleted"
        except Exception as e:  # the timeout is the news; say what is left behind
            fate = f"deleting it failed ({e}); delete it by hand"
        return JobTimeout(
            f"{ref} in {namespace} did not finish within {timeout_s:g}s "
            f"(last state: {verdict.state}); {fate}{tail}"
        )

    def _delete_for_stop(self, res: CustomResource, namespace: str, name: str) -> str:
        try:
            gone = self.delete(res, namespace, name)
        except Exception as e:
            return f"deleting {res.kind.lower()}/{name} failed ({e}); delete it by hand"
        return "the job has been deleted" if gone else "the job was already gone"

    # ------------------------------------------------------------------ watching

    def watch_object(
        self, res: CustomResource, namespace: str, name: str, deadline: float
    ) -> Iterator[dict[str, Any] | None]:
        """Each state of the object `name` as a watch (re-listed when it breaks) reports it,
        until the deadline; None when it is deleted or missing, which ends the iteration."""
        selector = {"field_selector": f"metadata.name={name}"}
        for event in self.events(self._list_custom(res, namespace), selector, deadline):
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
        deadline: float,
        stopped: Callable[[], bool] = lambda: False,
        on_open: Callable[[Any], None] | None = None,
    ) -> Iterator[_Event]:
        """A listing, then every change after it, until the deadline or `stopped()`.

        The watch resumes from the last resourceVersion seen (event or bookmark) when its
        stream ends or the connection drops; after 410 Gone (that version was compacted
        away) it lists again, and the caller sees a fresh `LIST`. Transient errors (429,
        5xx, connection errors) are retried with backoff; others are raised.
        """
        version: str | None = None
        failures = 0
        expired = 0  # 410s since the last event: a server that keeps answering 410 is paced
        watcher = k8s_watch.Watch()
        while not stopped():
            remaining = deadline - time.monotonic()
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
                    if stopped() or time.monotonic() >= deadline:
                        return
            except ApiException as e:
                if e.status == 410:  # compacted: list again, watch from there
                    version = None
                    expired += 1
                    if expired > 1:
                        self.pause(expired - 1, deadline, stopped)
                    continue
                if e.status not in TRANSIENT:
                    raise
                failures += 1
                self.pause(failures, deadline, stopped)
            except (OSError, urllib3.exceptions.HTTPError, json.JSONDecodeError):
                # The connection dropped or timed out: resume from `version`.
                failures += 1
                self.pause(failures, deadline, stopped)

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
