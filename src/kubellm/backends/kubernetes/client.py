"""What every Kubernetes launcher shares: create a custom object, watch it to a terminal state.

The Training Operator, Katib and KServe all report progress as `status.conditions`; the
launchers differ only in which condition means done and which means failed. Polling (not
watch) keeps this simple and robust to dropped connections; each job is one object that
changes state a handful of times.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException

from kubellm.backends.base import JobFailed, JobTimeout

# HTTP status codes a poll can survive: the API server or the network hiccuped.
_TRANSIENT = {429, 500, 502, 503, 504}
# The uid/gid of the `kubellm` user in containers/*/Dockerfile. Pinning it lets the kubelet
# check runAsNonRoot, and fsGroup makes the shared workspace volume writable for it.
RUN_AS_UID = 10001


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


def container_security() -> k8s.V1SecurityContext:
    return k8s.V1SecurityContext(
        allow_privilege_escalation=False, capabilities=k8s.V1Capabilities(drop=["ALL"])
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


class KubeClient:
    """The few API calls the launchers need, with the failure semantics of kubellm.backends.base.

    `api_client` lets tests (and callers with their own credentials) pass a configured
    client; otherwise one is loaded on first use, so constructing a launcher never needs a
    cluster.
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
        """Create, or replace the spec of an existing object of the same name (redeploys)."""
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

    def delete(self, res: CustomResource, namespace: str, name: str) -> bool:
        """Delete with its pods (background propagation); False when it was already gone."""
        try:
            self.custom.delete_namespaced_custom_object(
                res.group,
                res.version,
                namespace,
                res.plural,
                name,
                body=k8s.V1DeleteOptions(propagation_policy="Background"),
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
        """Poll until `done` or `failure` says so; on timeout delete the object and raise.

        `failure` returns the reason text of a terminal failure (JobFailed), or None.
        `describe` gives the one-word state printed when it changes and quoted in the
        timeout message, so a stuck object says why (e.g. `Ready=False (RevisionMissing)`).
        """
        ref = f"{res.kind.lower()}/{name}"
        deadline = time.monotonic() + timeout_s
        shown: str | None = None
        last = "never read"
        while True:
            obj = self._poll(res, namespace, name)
            if obj is not None:
                last = describe(obj)
                if last != shown:
                    print(f"{ref}: {last}", flush=True)
                    shown = last
                if done(obj):
                    return obj
                why = failure(obj)
                if why is not None:
                    raise JobFailed(f"{ref} in {namespace} failed: {why}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                try:
                    self.delete(res, namespace, name)
                    fate = "it has been deleted"
                except Exception as e:  # the timeout is the news; say what is left behind
                    fate = f"deleting it failed ({e}); delete it by hand"
                raise JobTimeout(
                    f"{ref} in {namespace} did not finish within {timeout_s:g}s "
                    f"(last state: {last}); {fate}"
                )
            time.sleep(min(self.poll_interval_s, remaining))

    def _poll(self, res: CustomResource, namespace: str, name: str) -> dict[str, Any] | None:
        """One read; None for a transient API error (the deadline still applies)."""
        try:
            obj = self.get(res, namespace, name)
        except ApiException as e:
            if e.status in _TRANSIENT:
                return None
            raise
        except (OSError, urllib3.exceptions.HTTPError):
            return None  # connection refused/reset: API servers restart, networks blip
        if obj is None:
            raise JobFailed(f"{res.kind.lower()}/{name} in {namespace} was deleted while waited on")
        return obj


def _rejected(
    res: CustomResource,
    namespace: str,
    body: dict[str, Any],
    verb: str,
    e: ApiException,
    hint: str = "",
) -> JobFailed:
    """JobFailed quoting the API server's Status message (it names the invalid field)."""
    try:
        status = json.loads(e.body or "")
    except (TypeError, ValueError):
        status = None
    message = status.get("message") if isinstance(status, dict) else None
    name = (body.get("metadata") or {}).get("name", "?")
    return JobFailed(
        f"{res.kind.lower()}/{name} in {namespace} was not {verb}: "
        f"HTTP {e.status} {message or e.reason or ''}{hint}"
    )
