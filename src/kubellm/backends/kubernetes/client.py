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

# HTTP status codes a request can survive: the API server or the network hiccuped.
_TRANSIENT = {429, 500, 502, 503, 504}
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
    """What `_events` reports: a fresh listing (`LIST`, with `items`) or one watch event."""

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


def _interrupt(resp: Any) -> None:
    """Wake a thread blocked reading `resp` (a urllib3 response) from another thread: shut
    its socket down, and leave closing the response to the reader (closing it under the
    reader's feet races inside http.client)."""
    try:
        resp.shutdown()  # urllib3 >= 2.3
    except AttributeError:
        with contextlib.suppress(Exception):
            resp.close()
    except Exception:  # already released or closed: nothing is blocked on it
        pass


def _chunks(resp: Any) -> Iterator[bytes]:
    """The body of a streamed response as it arrives (chunked or not)."""
    if hasattr(resp, "read1"):
        while data := resp.read1(65536):
            yield data
    else:  # urllib3 < 2.3: chunked responses (what the API server sends) stream per chunk
        yield from resp.stream(None)


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

    def pod_log(self, namespace: str, label_selector: str) -> tuple[str, str]:
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
        resp = self.core.read_namespaced_pod_log(
            pod, namespace, _preload_content=False, _request_timeout=self.request_timeout_s
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
        logs: _PodLogs | None = None
        with _sigterm_raises():
            try:
                obj, adopted = self._start(
                    res, namespace, body, done, failure, describe, deadline, say, replace_terminal
                )
                uid = (obj.get("metadata") or {}).get("uid")
                if follow_logs:
                    logs = _PodLogs(self, namespace, follow_logs, log_container, say, res, uid)
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
                    if e.status in _TRANSIENT and time.monotonic() < deadline:
                        failures += 1
                        self._pause(failures, deadline)
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
        for event in self._events(self._list_custom(res, namespace), selector, deadline):
            if event.type == "LIST":
                if not any((o.get("metadata") or {}).get("uid") == uid for o in event.items):
                    return
            elif event.type == "DELETED" or _uid(event.obj) != uid:
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
        selector = {"field_selector": f"metadata.name={name}"}
        for event in self._events(self._list_custom(res, namespace), selector, deadline):
            if event.type == "LIST":
                found = [o for o in event.items if (o.get("metadata") or {}).get("name") == name]
                if not found:
                    return _Verdict("deleted", None, last)
                obj = found[0]
            elif event.type in ("ADDED", "MODIFIED", "DELETED"):
                obj = event.obj
                if (obj.get("metadata") or {}).get("name") != name:
                    continue  # a server that ignores the field selector
                if event.type == "DELETED":
                    return _Verdict("deleted", None, last)
            else:
                continue
            if uid is not None and _uid(obj) not in (None, uid):
                return _Verdict("replaced", obj, last)
            uid = uid or _uid(obj)
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

    def _list_custom(self, res: CustomResource, namespace: str) -> _Lister:
        return _Lister(
            self.custom.list_namespaced_custom_object,
            (res.group, res.version, namespace, res.plural),
        )

    def _events(
        self,
        lister: _Lister,
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
                        self._pause(expired - 1, deadline, stopped)
                    continue
                if e.status not in _TRANSIENT:
                    raise
                failures += 1
                self._pause(failures, deadline, stopped)
            except (OSError, urllib3.exceptions.HTTPError, json.JSONDecodeError):
                # The connection dropped or timed out: resume from `version`.
                failures += 1
                self._pause(failures, deadline, stopped)

    def _pause(
        self, failures: int, deadline: float, stopped: Callable[[], bool] = lambda: False
    ) -> None:
        """Back off after the `failures`-th error in a row, never past the deadline."""
        pause = min(self.poll_interval_s, 0.2 * 2 ** min(failures - 1, 10))
        end = min(time.monotonic() + pause, deadline)
        while not stopped() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))


@dataclass(frozen=True)
class _Lister:
    """A list call of the generated client (custom objects or pods) and its positional args."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]

    def opened(self, on_open: Callable[[Any], None] | None) -> Callable[..., Any]:
        """`fn` for Watch.stream: without the generated docstring, Watch hands back raw dicts
        (no model deserialization), and `on_open` sees each response (to shut it down)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            resp = self.fn(*args, **kwargs)
            if on_open is not None:
                on_open(resp)
            return resp

        return call


def _uid(obj: dict[str, Any]) -> str | None:
    uid = (obj.get("metadata") or {}).get("uid")
    return str(uid) if uid else None


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


@dataclass
class _Segment:
    """The log of one container run: a pod (by uid) and its restart count."""

    pod: str
    data: bytearray = field(default_factory=bytearray)
    partial: bytearray = field(default_factory=bytearray)  # a line not yet ended by "\n"
    complete: bool = False  # read up to the end of a container that has terminated


class _PodLogs:
    """Follows the logs of the pods a label selector picks, in background threads.

    A discovery thread watches the pods; each pod (by uid) whose container has started gets
    a follower thread that streams its log (`follow=true`), echoes each line prefixed with
    the pod's name and keeps the bytes. A stream that ends while the container runs (the
    connection dropped) is opened again and what was already read is skipped; a pod
    replaced under the same name (new uid) gets its own follower. Pods controlled by
    another incarnation of the job (`kind` with a different uid) are not followed.
    """

    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        selector: str,
        container: str | None,
        echo: Callable[[str], None],
        owner: CustomResource,
        owner_uid: str | None,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.selector = selector
        self.container = container
        self.echo = echo
        self.owner_kind = owner.kind
        self.owner_uid = owner_uid
        self._lock = threading.Lock()
        self._segments: dict[tuple[str, int], _Segment] = {}  # in the order they started
        self._followed: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._open: set[Any] = set()  # log streams being read, for close() to cut
        self._watch: Any = None  # the discovery's current watch response, likewise
        self._closing = threading.Event()  # the job is over: finish current streams
        self._stop = threading.Event()  # stop now
        self._closed = False
        self._errors: list[str] = []

    def start(self) -> None:
        self._spawn(self._discover, f"logs:{self.selector}")

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            if self._stop.is_set():
                return
            thread.start()
            self._threads.append(thread)

    def _track(self, resp: Any) -> None:
        with self._lock:
            self._open.add(resp)
        if self._stop.is_set():
            _interrupt(resp)

    def _watching(self, resp: Any) -> None:
        """The discovery opened a watch (Watch.stream closes it when done)."""
        with self._lock:
            self._watch = resp
        if self._stop.is_set():
            _interrupt(resp)

    def _untrack(self, resp: Any) -> None:
        with self._lock:
            self._open.discard(resp)

    # ----------------------------------------------------------- threads

    def _discover(self) -> None:
        lister = _Lister(self.kube.core.list_namespaced_pod, (self.namespace,))
        try:
            for event in self.kube._events(
                lister,
                {"label_selector": self.selector},
                math.inf,
                stopped=self._stop.is_set,
                on_open=self._watching,
            ):
                pods = event.items if event.type == "LIST" else (event.obj,)
                if event.type == "DELETED":
                    continue
                for pod in pods:
                    self._maybe_follow(pod)
        except Exception as e:  # a log we cannot read is reported, never fatal to the job
            self._errors.append(f"watching pods {self.selector}: {e}")

    def _maybe_follow(self, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        name = str(meta.get("name") or "")
        uid = str(meta.get("uid") or name)
        if not name or uid in self._followed or self._stop.is_set():
            return
        if (pod.get("status") or {}).get("phase") not in ("Running", "Succeeded", "Failed"):
            return  # its container has not started: no log yet
        for ref in meta.get("ownerReferences") or []:
            theirs = ref.get("controller") and ref.get("kind") == self.owner_kind
            if theirs and self.owner_uid and ref.get("uid") != self.owner_uid:
                return  # a pod of an earlier job of this name, on its way out
        self._followed.add(uid)
        self._spawn(self._follow, f"log:{name}", name, uid)

    def _follow(self, pod: str, uid: str) -> None:
        failures = 0
        restarts = -1
        segment: _Segment | None = None
        while not self._stop.is_set():
            state, restarts_now = self._pod_state(pod, uid)
            if state == "gone":
                return
            if segment is None or restarts_now != restarts:
                restarts = restarts_now
                with self._lock:
                    segment = self._segments.setdefault((uid, restarts), _Segment(pod))
            ended = self._stream(pod, segment)
            if ended in ("fatal", "stopped"):
                return  # a stopped stream may have missed the end: close() reads it again
            if ended == "retry":
                failures += 1
                self.kube._pause(failures, math.inf, self._stop.is_set)
                continue
            failures = 0
            state, _ = self._pod_state(pod, uid)
            if state in ("terminated", "gone"):
                segment.complete = state == "terminated"
                return
            if self._closing.is_set():
                return
            # The stream ended with the container still running (a dropped connection, a
            # restart): open it again, after a pause so a stream that ends at once is no loop.
            self.kube._pause(1, math.inf, self._stop.is_set)

    def _stream(self, pod: str, segment: _Segment) -> Literal["end", "retry", "fatal", "stopped"]:
        """Read the log from its start, skipping what `segment` already has: `end` when the
        stream ended, `stopped` when close() cut it, `retry` after an error worth retrying,
        `fatal` after one that is not."""
        kwargs: dict[str, Any] = {"container": self.container} if self.container else {}
        try:
            resp = self.kube.core.read_namespaced_pod_log(
                pod,
                self.namespace,
                follow=True,
                _preload_content=False,
                _request_timeout=(self.kube.request_timeout_s, None),
                **kwargs,
            )
        except ApiException as e:
            if e.status in (404, *_TRANSIENT) or _not_started(e):  # gone, a hiccup, too early
                return "retry"
            self._errors.append(f"reading the log of {pod}: HTTP {e.status} {_message(e)}")
            return "fatal"  # e.g. 400 for a container the pod does not have, 403
        except (OSError, urllib3.exceptions.HTTPError):
            return "retry"
        self._track(resp)
        skip = len(segment.data)
        try:
            for chunk in _chunks(resp):
                if skip:
                    dropped = min(skip, len(chunk))
                    chunk, skip = chunk[dropped:], skip - dropped
                if chunk:
                    self._append(segment, chunk)
        except Exception:  # a dropped connection (or one shut down by close())
            return "stopped" if self._stop.is_set() else "retry"
        finally:
            self._untrack(resp)
            with contextlib.suppress(Exception):
                resp.close()
        return "stopped" if self._stop.is_set() else "end"

    def _pod_state(self, pod: str, uid: str) -> tuple[str, int]:
        """(`running` | `terminated` | `gone`, restart count of the log's container)."""
        try:
            obj = self.kube.core.read_namespaced_pod(
                pod,
                self.namespace,
                _preload_content=False,
                _request_timeout=self.kube.request_timeout_s,
            )
            data = json.loads(obj.data)
        except ApiException as e:
            if e.status == 404:
                return "gone", 0
            return "running", 0
        except (OSError, urllib3.exceptions.HTTPError, ValueError):
            return "running", 0
        meta = data.get("metadata") or {}
        if (meta.get("uid") or meta.get("name")) != uid:
            return "gone", 0
        status = data.get("status") or {}
        statuses = status.get("containerStatuses") or []
        mine = [s for s in statuses if s.get("name") == self.container] or statuses[:1]
        restarts = int(mine[0].get("restartCount") or 0) if mine else 0
        if status.get("phase") in ("Succeeded", "Failed"):
            return "terminated", restarts
        return "running", restarts

    def _append(self, segment: _Segment, chunk: bytes) -> None:
        with self._lock:
            segment.data += chunk
            segment.partial += chunk
            *lines, rest = bytes(segment.partial).split(b"\n")
            segment.partial = bytearray(rest)
        for line in lines:
            self.echo(f"[{segment.pod}] {line.decode('utf-8', 'replace')}")

    # ----------------------------------------------------------- the end

    def close(self, drain_s: float) -> str:
        """Stop following (after up to `drain_s` for the streams to reach their end) and
        return the whole text. Idempotent: later calls return the same text."""
        if not self._closed:
            self._closed = True
            self._closing.set()
            end = time.monotonic() + drain_s
            # Followers may still start (a pod seen late): wait for those too, to the end.
            while (left := end - time.monotonic()) > 0 and (alive := self._followers()):
                alive[0].join(left)
            with self._lock:
                self._stop.set()  # no follower starts after this
                streams = [*self._open, *([self._watch] if self._watch is not None else [])]
            for resp in streams:
                _interrupt(resp)
            for thread in list(self._threads):
                thread.join(1.0)
            if drain_s > 0:
                self._complete()
            for segment in list(self._segments.values()):
                if segment.partial:
                    self.echo(f"[{segment.pod}] {segment.partial.decode('utf-8', 'replace')}")
                    segment.partial.clear()
            if not self._segments and drain_s > 0:
                self._fallback()
        return self.text()

    def _followers(self) -> list[threading.Thread]:
        """The follower threads still running."""
        with self._lock:
            return [t for t in self._threads if t.name.startswith("log:") and t.is_alive()]

    def _complete(self) -> None:
        """Read once more (no follow) the pods whose stream ended before their container
        did, and keep what the stream missed."""
        for (uid, _), segment in list(self._segments.items()):
            if segment.complete:
                continue
            state, _ = self._pod_state(segment.pod, uid)
            if state == "gone":
                continue
            try:
                data = self._read(segment.pod)
            except ApiException as e:
                self._errors.append(
                    f"reading the log of {segment.pod}: HTTP {e.status} {_message(e)}"
                )
                continue
            except Exception as e:
                self._errors.append(f"reading the log of {segment.pod}: {e}")
                continue
            if len(data) > len(segment.data) and data.startswith(bytes(segment.data)):
                self._append(segment, data[len(segment.data) :])

    def _fallback(self) -> None:
        """No pod was followed (it came and went between two looks): read the log once, of
        the pod `KubeClient.pod_log` would pick."""
        try:
            pods = self.kube.core.list_namespaced_pod(
                self.namespace,
                label_selector=self.selector,
                _request_timeout=self.kube.request_timeout_s,
            ).items
            if not pods:
                raise LookupError(f"no pod in {self.namespace} matches {self.selector}")
            pods.sort(key=lambda p: (p.status.phase != "Succeeded", p.metadata.name))
            pod = pods[0].metadata.name
            data = self._read(pod)
        except ApiException as e:
            self._errors.append(
                f"reading the log of {self.selector}: HTTP {e.status} {_message(e)}"
            )
            return
        except Exception as e:
            self._errors.append(f"reading the log of {self.selector}: {e}")
            return
        segment = _Segment(pod)
        self._segments[(pod, 0)] = segment
        self._append(segment, data)

    def _read(self, pod: str) -> bytes:
        kwargs: dict[str, Any] = {"container": self.container} if self.container else {}
        resp = self.kube.core.read_namespaced_pod_log(
            pod,
            self.namespace,
            _preload_content=False,
            _request_timeout=self.kube.request_timeout_s,
            **kwargs,
        )
        data = resp.data
        return data if isinstance(data, bytes) else str(data).encode()

    def text(self) -> str:
        """Every segment's text in the order they started, each but the last ended by a
        newline so one's last line does not run into the next one's first."""
        with self._lock:
            parts = [bytes(s.data) for s in self._segments.values() if s.data]
        ended = [p if p.endswith(b"\n") else p + b"\n" for p in parts[:-1]]
        return b"".join([*ended, *parts[-1:]]).decode("utf-8", "replace")

    def tail(self, lines: int) -> str:
        """The last `lines` lines of the newest log, headed by its pod's name; empty if none."""
        with self._lock:
            segments = [s for s in self._segments.values() if s.data.strip()]
        if not segments:
            return ""
        last = segments[-1]
        text = bytes(last.data).decode("utf-8", "replace").rstrip()
        return f"\n--- last lines of {last.pod} ---\n" + "\n".join(text.splitlines()[-lines:])

    def error(self, text: str) -> str | None:
        """Why no log came back, if none did."""
        if text or not self._errors:
            return None
        return "; ".join(dict.fromkeys(self._errors))  # each once


def _message(e: ApiException) -> str:
    """The message of the API server's Status in `e`, else its HTTP reason."""
    try:
        status = json.loads(e.body or "")
    except (TypeError, ValueError):
        status = None
    message = status.get("message") if isinstance(status, dict) else None
    return str(message or e.reason or "")


def _not_started(e: ApiException) -> bool:
    """A 400 for a log asked for too early: `container "x" in pod "y" is waiting to start:
    ContainerCreating` (or PodInitializing); other 400s will not pass by themselves."""
    return e.status == 400 and any(
        word in _message(e) for word in ("waiting to start", "PodInitializing")
    )


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
        f"HTTP {e.status} {_message(e)}{hint}"
    )
