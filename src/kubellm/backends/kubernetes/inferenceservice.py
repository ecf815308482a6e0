"""Serve a model on KServe (v1beta1 InferenceService), rolled out as a canary where a
previous version serves.

Two runtimes answer the same routes (KServe V1/V2 and /openai/v1):

- `huggingface` (default): `spec.predictor.model` with modelFormat `huggingface`; KServe picks
  its Hugging Face ClusterServingRuntime (config/runtimes/kserve-huggingfaceserver.yaml in
  kserve/kserve), whose storage initializer puts `storageUri` at /mnt/models, the runtime's
  default `--model_dir`.
- `custom`: our serving image running `kubellm serve /mnt/models`; KServe learns where the model
  is from the container's `STORAGE_URI` variable.

A deployment is two-phase (kubellm.backends.base.Server). `deploy` creates the service (all
traffic), or, where a revision is rolled out, updates it with `canaryTrafficPercent`: KServe's
Knative reconciler (pkg/controller/v1beta1/inferenceservice/reconcilers/knative/
ksvc_reconciler.go) then splits traffic between the new revision (tag `latest`) and the last
rolled-out one (tag `prev`), and with `serving.kserve.io/enable-tag-routing` each tag has its own
address, which the smoke test calls. `promote` removes `canaryTrafficPercent` (KServe's
documented promotion: all traffic to the latest ready revision); `rollback` sets it to 0 (its
documented rollback: all traffic to the previous revision). Nothing is deleted while a
previous revision serves; only a first deployment that fails is removed.

Canary rollouts need KServe's Knative ("Serverless") deployment mode, the default of KServe's
shipped configuration (config/configmap/inferenceservice.yaml); in Standard (RawDeployment)
mode `deploy` refuses to update a serving model rather than replace it in place.

Example (a cluster with KServe):

    InferenceServiceServer().deploy(ServeRequest(name="llm", namespace="team-a",
        model_uri="pvc://kubellm-workspace/serve/v3", version="3"))
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kserve import (
    V1beta1InferenceService,
    V1beta1InferenceServiceSpec,
    V1beta1ModelFormat,
    V1beta1ModelSpec,
    V1beta1PredictorSpec,
)
from kserve.constants import constants as ks
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from kubellm.backends.base import (
    JobFailed,
    JobTimeout,
    Rollout,
    Server,
    ServeRequest,
)
from kubellm.backends.kubernetes.client import (
    RUN_AS_UID,
    CustomResource,
    KubeClient,
    condition_is_true,
    container_security,
    find_condition,
    to_dict,
)
from kubellm.backends.kubernetes.podspec import MANAGED_BY, RUN_LABEL, label_value
from kubellm.backends.kubernetes.responses import TRANSIENT, api_message
from kubellm.serve.client import Endpoint

INFERENCESERVICE = CustomResource(
    ks.KSERVE_GROUP,
    ks.KSERVE_V1BETA1_VERSION,
    ks.KSERVE_PLURAL_INFERENCESERVICE,
    ks.KSERVE_KIND_INFERENCESERVICE,
)
# KServe injects the storage initializer for, and routes traffic to, this container only
# (pkg/constants/constants.go InferenceServiceContainerName).
CONTAINER = "kserve-container"
MODEL_DIR = "/mnt/models"  # constants.go DefaultModelLocalMountPath
PORT = 8080  # constants.go InferenceServiceDefaultHttpPort
SCRATCH = "/tmp"
RUN_TAG_ANNOTATION = "kubellm/run-tag"
MODEL_VERSION_ANNOTATION = "kubellm/model-version"
# constants.go EnableRoutingTagAnnotationKey: the `latest` and `prev` traffic targets get tags,
# so each revision has its own address (ksvc_reconciler.go createKnativeService).
TAG_ROUTING_ANNOTATION = "serving.kserve.io/enable-tag-routing"
LATEST_TAG = "latest"
PREV_TAG = "prev"
HF_FORMAT = "huggingface"
# python/huggingface_server*.Dockerfile: `USER 1000` owns the runtime's files; its HF_HOME is
# /tmp/huggingface, the emptyDir below.
HF_RUNTIME_UID = 1000
# Model states after which KServe will not become ready without a new spec.
_BLOCKED = {"BlockedByFailedLoad", "InvalidSpec"}
# inference_service_validation.go IsvcNameFmt (the validating webhook's name rule).
_ISVC_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# pkg/controller/v1beta1/inferenceservice/utils/utils.go SupportedStorageURIPrefixList: the
# schemes KServe's storage initializer downloads (a path without a scheme is local).
STORAGE_SCHEMES = (
    "gs://",
    "s3://",
    "pvc://",
    "file://",
    "https://",
    "http://",
    "hdfs://",
    "webhdfs://",
    "oci://",
    "oci+native://",
    "oci+fetch://",
    "hf://",
)
# constants.go DeploymentModeType: the names of Knative mode, current and legacy.
_KNATIVE_MODES = ("Knative", "Serverless")
# A replace that meets a newer resourceVersion (the controller wrote status) reads and retries.
_UPDATE_ATTEMPTS = 5


def _check(request: ServeRequest) -> None:
    """What KServe would reject later (or never report), refused before anything is sent."""
    where = f"ServeRequest {request.name!r}"
    if not _ISVC_NAME.match(request.name) or len(request.name) > 63:
        raise ValueError(
            f"{where}: an InferenceService name must be a DNS-1035 label "
            f"(KServe's IsvcNameFmt {_ISVC_NAME.pattern})"
        )
    if not request.model_uri:
        raise ValueError(f"{where}: model_uri is required")
    if "://" in request.model_uri and not request.model_uri.startswith(STORAGE_SCHEMES):
        raise ValueError(
            f"{where}: KServe's storage initializer cannot fetch {request.model_uri} "
            f"(schemes: {', '.join(STORAGE_SCHEMES)})"
        )
    if request.runtime == "custom" and not request.image:
        raise ValueError(f"{where}: runtime 'custom' needs the serving image (image)")
    if request.runtime not in ("huggingface", "custom"):
        raise ValueError(f"{where}: unknown runtime {request.runtime!r}")
    if not 0 <= request.canary_traffic_percent <= 100:
        # Knative's route validation rejects a traffic percent outside [0, 100]; KServe's
        # webhook does not check it, so the InferenceService would only fail to reconcile.
        raise ValueError(f"{where}: canary_traffic_percent must be within 0..100")
    res = request.resources
    # component.go validateReplicas (the webhook): min >= 0, max >= 0, min <= max unless max 0.
    if res.min_replicas < 0 or res.max_replicas < 0 or res.gpus < 0:
        raise ValueError(f"{where}: replicas and gpus must not be negative")
    if res.max_replicas and res.min_replicas > res.max_replicas:
        raise ValueError(f"{where}: min_replicas {res.min_replicas} > max {res.max_replicas}")


def _resources(request: ServeRequest) -> k8s.V1ResourceRequirements:
    """requests = limits (Guaranteed QoS); a GPU is an extended resource, limits only count."""
    res = request.resources
    amounts: dict[str, str] = {"cpu": res.cpu, "memory": res.memory}
    if res.gpus > 0:
        amounts["nvidia.com/gpu"] = str(res.gpus)
    return k8s.V1ResourceRequirements(requests=dict(amounts), limits=dict(amounts))


def _scratch_mount() -> list[k8s.V1VolumeMount]:
    return [k8s.V1VolumeMount(name="scratch", mount_path=SCRATCH)]


def _hf_model(request: ServeRequest) -> V1beta1ModelSpec:
    """The Hugging Face runtime's model: its args are appended to the runtime's own
    (`--model_name={{.Name}}`; utils.go MergeRuntimeContainers concatenates them)."""
    # python/huggingfaceserver/huggingfaceserver/__main__.py: --model_name names the model in
    # the routes (the runtime's template sets the same; stated so the smoke test never depends
    # on a cluster's runtime template). --backend=huggingface on CPU: `auto` would pick vLLM
    # where the image has it, which needs a GPU.
    args = [f"--model_name={request.name}"]
    if request.resources.gpus == 0:
        args.append("--backend=huggingface")
    return V1beta1ModelSpec(
        model_format=V1beta1ModelFormat(name=HF_FORMAT),
        storage_uri=request.model_uri,
        args=args,
        # The image sets HF_HOME=/tmp/huggingface; HOME too must be writable (caches of
        # torch, triton, vLLM) under a read-only root filesystem.
        env=[k8s.V1EnvVar(name="HOME", value=SCRATCH)],
        resources=_resources(request),
        security_context=container_security(read_only_root=True),
        volume_mounts=_scratch_mount(),
    )


def _custom_container(request: ServeRequest) -> k8s.V1Container:
    """Our serving image: `kubellm serve` on what the storage initializer put at /mnt/models."""
    return k8s.V1Container(
        name=CONTAINER,
        image=request.image,
        command=["kubellm"],
        args=["serve", MODEL_DIR, "--name", request.name, "--host", "0.0.0.0", "--port", str(PORT)],
        env=[
            k8s.V1EnvVar(name="STORAGE_URI", value=request.model_uri),
            k8s.V1EnvVar(name="HOME", value=SCRATCH),
        ],
        ports=[k8s.V1ContainerPort(container_port=PORT, protocol="TCP")],
        resources=_resources(request),
        # A read-only root filesystem; the server's temporary files go to an emptyDir.
        security_context=container_security(read_only_root=True),
        volume_mounts=_scratch_mount(),
    )


def _pod_security(uid: int) -> k8s.V1PodSecurityContext:
    """Non-root as `uid`, the image's own user (the Pod Security "restricted" profile)."""
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=uid,
        run_as_group=uid,
        fs_group=uid,
        fs_group_change_policy="OnRootMismatch",
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def build_inferenceservice(request: ServeRequest, *, canary: bool = False) -> dict[str, Any]:
    """The InferenceService body for `request`; with `canary`, the update that gives the new
    revision `request.canary_traffic_percent` of the traffic beside the rolled-out one (only
    meaningful where one is: ksvc_reconciler.go splits traffic only then)."""
    _check(request)
    hf = request.runtime == "huggingface"
    res = request.resources
    predictor = V1beta1PredictorSpec(
        model=_hf_model(request) if hf else None,
        containers=None if hf else [_custom_container(request)],
        volumes=[k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource())],
        min_replicas=res.min_replicas,
        max_replicas=res.max_replicas,
        canary_traffic_percent=request.canary_traffic_percent if canary else None,
        security_context=_pod_security(HF_RUNTIME_UID if hf else RUN_AS_UID),
        # The model server never calls the Kubernetes API: no token in the pod.
        automount_service_account_token=False,
    )
    annotations = {TAG_ROUTING_ANNOTATION: "true"}
    labels = dict(MANAGED_BY)
    if request.run_tag:
        annotations[RUN_TAG_ANNOTATION] = request.run_tag
        if value := label_value(request.run_tag):
            labels[RUN_LABEL] = value  # `kubectl get isvc -l kubellm.dev/run=...`, as jobs
    if request.version:
        annotations[MODEL_VERSION_ANNOTATION] = request.version
    isvc = V1beta1InferenceService(
        api_version=INFERENCESERVICE.api_version,
        kind=INFERENCESERVICE.kind,
        metadata=k8s.V1ObjectMeta(
            name=request.name,
            namespace=request.namespace,
            labels=labels,
            annotations=annotations,
        ),
        spec=V1beta1InferenceServiceSpec(predictor=predictor),
    )
    out: dict[str, Any] = to_dict(isvc)
    model = out["spec"]["predictor"].get("model")
    if model is not None and not model.get("name"):
        # the SDK's ModelSpec defaults its container `name` to "": leave it out, the webhook
        # refuses a name in a standard predictor (inference_service_validation.go)
        model.pop("name", None)
    return out


# ---------------------------------------------------------------- reading KServe's status


def ready_state(obj: dict[str, Any]) -> str:
    """`Ready`, or why not (`Ready=False (RevisionFailed: ...)`): what a timeout reports."""
    cond = find_condition(obj, "Ready")
    if cond is None:
        return "Pending"
    if str(cond.get("status")) == "True":
        return "Ready"
    why = ": ".join(str(cond[k]) for k in ("reason", "message") if cond.get(k))
    return f"Ready={cond.get('status')}" + (f" ({why})" if why else "")


def predictor_status(obj: dict[str, Any]) -> dict[str, Any]:
    """status.components.predictor: the revisions and traffic KServe copies from Knative
    (inference_service_status.go PropagateStatus)."""
    components = (obj.get("status") or {}).get("components") or {}
    return dict(components.get("predictor") or {})


def traffic_of(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list(predictor_status(obj).get("traffic") or [])


def traffic_by_revision(obj: dict[str, Any]) -> dict[str, int]:
    """Percent of traffic per revision (a revision may appear under two targets)."""
    out: dict[str, int] = {}
    for t in traffic_of(obj):
        rev = str(t.get("revisionName") or "")
        out[rev] = out.get(rev, 0) + int(t.get("percent") or 0)
    return out


def _target(obj: dict[str, Any], tag: str) -> dict[str, Any] | None:
    return next((t for t in traffic_of(obj) if t.get("tag") == tag), None)


def describe(obj: dict[str, Any]) -> str:
    """The Ready state, plus a revision still starting and the traffic split, as printed."""
    pred = predictor_status(obj)
    created, ready = pred.get("latestCreatedRevision"), pred.get("latestReadyRevision")
    notes = []
    if created and created != ready:
        notes.append(f"{created} not ready")
    shares = [
        f"{t.get('revisionName', '?')} {int(t.get('percent') or 0)}%"
        + (f" ({t['tag']})" if t.get("tag") else "")
        for t in traffic_of(obj)
    ]
    if shares:
        notes.append("traffic " + ", ".join(shares))
    return ready_state(obj) + (f" [{'; '.join(notes)}]" if notes else "")


def _url(obj: dict[str, Any], cluster_local: bool) -> str:
    """The service's address: cluster-local (`address.url`) or through the ingress (`url`)."""
    status = obj.get("status") or {}
    public = status.get("url") or ""
    internal = (status.get("address") or {}).get("url") or ""
    return (internal or public) if cluster_local else (public or internal)


def tag_url(obj: dict[str, Any], tag: str, cluster_local: bool) -> str:
    """The address of one tagged revision, `""` while it has none.

    Knative reports each tag's URL through the ingress (`http://latest-<route>.<ns>.<domain>`).
    In the cluster, it also makes a Service `<tag>-<route>` for each tag (Knative's default
    tag-template; knative docs "Creating and using Subroutes"), so the cluster-local address
    is the predictor's `address.url` host with `<tag>-` in front. An address that is no
    Service name (an IP: the simulated cluster) has no tag Services: the URL is used then.
    """
    target = _target(obj, tag)
    url = str((target or {}).get("url") or "")
    if not url or not cluster_local:
        return url
    address = str((predictor_status(obj).get("address") or {}).get("url") or "")
    parts = urlsplit(address)
    host = parts.hostname or ""
    if ".svc" not in host:
        return url
    netloc = f"{tag}-{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, "", "", ""))


def _generation_observed(obj: dict[str, Any]) -> bool:
    """After an update, Ready may still describe the previous spec until reconciled. KServe
    copies the Knative Service's observedGeneration (PropagateStatus), which moves with ours
    when the update changes the revision template, as a new model always does."""
    generation = (obj.get("metadata") or {}).get("generation")
    observed = (obj.get("status") or {}).get("observedGeneration")
    return generation is None or observed is None or observed >= generation


def _blocked(obj: dict[str, Any]) -> str | None:
    """KServe's verdict that the model cannot load (a spec change is needed), else None."""
    model = (obj.get("status") or {}).get("modelStatus") or {}
    if model.get("transitionStatus") not in _BLOCKED:
        return None
    info = model.get("lastFailureInfo") or {}
    parts = [str(info[k]) for k in ("reason", "message") if info.get(k)]
    return ": ".join(parts) or f"{model['transitionStatus']} ({ready_state(obj)})"


def _deployment_mode(obj: dict[str, Any]) -> str:
    """The mode KServe recorded (status.deploymentMode), `""` before it reconciled."""
    return str((obj.get("status") or {}).get("deploymentMode") or "")


def serving_revision(obj: dict[str, Any]) -> str:
    """The last revision rolled out to all traffic, if it still takes some: what serves
    while a canary is tried. `""` when none (a first deployment, or one never ready)."""
    rolled = str(predictor_status(obj).get("latestRolledoutRevision") or "")
    return rolled if rolled and traffic_by_revision(obj).get(rolled, 0) > 0 else ""


def _contains(have: Any, want: Any) -> bool:
    """Whether `have` holds everything `want` sets (a stored spec may carry defaults)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_contains(have.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(have) == len(want)
            and all(_contains(h, w) for h, w in zip(have, want, strict=True))
        )
    return bool(have == want)


def _without_canary(predictor: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in predictor.items() if k != "canaryTrafficPercent"}


@dataclass(frozen=True)
class _Seen:
    """How a wait ended: done, failed (with `why`), deleted or timeout."""

    outcome: str
    obj: dict[str, Any] | None
    state: str
    why: str = ""


Check = Callable[[dict[str, Any]], bool]
Failure = Callable[[dict[str, Any]], str | None]


class InferenceServiceServer(Server):
    """Server on a cluster: one InferenceService per model name, rolled out revision by
    revision (see the module docstring).

    `namespace` is where `delete`, `promote` and `rollback` look when not told (a cleanup
    step in another process has only the name). `cluster_local` (the default) returns
    in-cluster addresses: pipeline steps run in pods, where the ingress host may not
    resolve. `traffic_timeout_s` bounds the waits for a traffic change (promote, rollback).
    """

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        *,
        namespace: str = "default",
        poll_interval_s: float = 5.0,
        request_timeout_s: float = 30.0,
        cluster_local: bool = True,
        traffic_timeout_s: float = 300.0,
    ) -> None:
        self.kube = KubeClient(api_client, poll_interval_s, request_timeout_s)
        self.namespace = namespace
        self.cluster_local = cluster_local
        self.traffic_timeout_s = traffic_timeout_s
        self._deployed: dict[str, str] = {}  # name -> namespace, so later calls find our own

    # ------------------------------------------------------------------ Server

    def deploy(self, request: ServeRequest) -> Rollout:
        """Create the service, or roll the new version out beside the one that serves.

        First deployment (or one where nothing serves): all traffic, Rollout(canary=False)
        with the service's address; if it never becomes ready it is deleted and JobFailed
        (JobTimeout) says why. Where a revision serves: an update with canaryTrafficPercent;
        Rollout(canary=True, previous=<that revision>) with the new revision's own address.
        A canary that never becomes ready gets 0% again and JobFailed says why; the previous
        revision serves throughout.
        """
        body = build_inferenceservice(request)
        ns, name = request.namespace, request.name
        self._deployed[name] = ns
        current = self._get(ns, name)
        if current is not None and (current.get("metadata") or {}).get("deletionTimestamp"):
            self._await(ns, name, request.timeout_s, lambda o: False, lambda o: None)
            current = self._get(ns, name)
        if current is None:
            self._create(ns, body)
            return self._await_first(request, stale=set(), put_status=None)
        previous = serving_revision(current)
        same = self._same_template(current, body)
        pred = predictor_status(current)
        created = str(pred.get("latestCreatedRevision") or "")
        if not previous:  # nothing serves: replacing it takes nothing away
            updated = self._update(ns, name, lambda o: self._apply(o, body))
            stale = set() if same else {created}
            return self._await_first(request, stale, updated.get("status"))
        mode = _deployment_mode(current)
        if mode and mode not in _KNATIVE_MODES:
            raise JobFailed(
                f"inferenceservice/{name} in {ns} runs in KServe's {mode} deployment mode, "
                "which has no canary traffic split (Knative mode only); nothing was changed, "
                f"revision {previous} still serves"
            )
        if same and created == previous:
            print(f"inferenceservice/{name}: this version already serves ({previous})", flush=True)
            return Rollout(Endpoint(name, _url(current, self.cluster_local)))
        canary = build_inferenceservice(request, canary=True)
        updated = self._update(ns, name, lambda o: self._apply(o, canary))
        stale = {previous} if same else {previous, created}
        return self._await_canary(request, previous, stale, updated.get("status"))

    def promote(self, name: str, namespace: str = "") -> Endpoint:
        """All traffic to the latest ready revision (KServe's promotion: no
        canaryTrafficPercent); returns the service's address once KServe reports it rolled
        out. JobFailed when the latest revision is not ready (traffic is left alone)."""
        ns = namespace or self._deployed.get(name, self.namespace)
        obj = self._get(ns, name)
        if obj is None:
            raise JobFailed(f"inferenceservice/{name} in {ns} not found: nothing to promote")
        pred = predictor_status(obj)
        new = str(pred.get("latestReadyRevision") or "")
        created = str(pred.get("latestCreatedRevision") or "")
        if not new or created != new:
            raise JobFailed(
                f"inferenceservice/{name} in {ns}: revision {created or '?'} is not ready, "
                f"nothing to promote; traffic unchanged ({describe(obj)})"
            )
        if "canaryTrafficPercent" in ((obj.get("spec") or {}).get("predictor") or {}):
            self._update(ns, name, lambda o: o["spec"]["predictor"].pop("canaryTrafficPercent"))

        def rolled_out(o: dict[str, Any]) -> bool:
            p = predictor_status(o)
            latest = _target(o, LATEST_TAG) or {}
            return (
                p.get("latestRolledoutRevision") == new
                and traffic_by_revision(o).get(new) == 100
                and latest.get("revisionName") in (None, new)
                and condition_is_true(o, "Ready")
                and bool(_url(o, self.cluster_local))
            )

        seen = self._await(ns, name, self.traffic_timeout_s, rolled_out, lambda o: None)
        if seen.outcome != "done" or seen.obj is None:
            raise self._traffic_error(ns, name, f"revision {new} to all traffic", seen)
        print(f"inferenceservice/{name}: {new} takes all traffic", flush=True)
        return Endpoint(name, _url(seen.obj, self.cluster_local))

    def rollback(self, name: str, run_tag: str = "", namespace: str = "") -> str:
        """Traffic back to the previous rolled-out revision (canaryTrafficPercent 0, KServe's
        rollback); with none (a first deployment), delete the service if run `run_tag`
        deployed it. Never deletes while a previous revision serves, and changes nothing
        where another run's deployment is now in place."""
        ns = namespace or self._deployed.get(name, self.namespace)
        ref = f"inferenceservice/{name} in {ns}"
        obj = self._get(ns, name)
        if obj is None:
            return f"{ref} not found: nothing to roll back"
        owner = ((obj.get("metadata") or {}).get("annotations") or {}).get(RUN_TAG_ANNOTATION)
        if run_tag and owner != run_tag:
            return f"{ref} kept as it is: run {owner!r} deployed it, not {run_tag!r}"
        pred = predictor_status(obj)
        created = str(pred.get("latestCreatedRevision") or "")
        rolled = serving_revision(obj)
        before = str(pred.get("previousRolledoutRevision") or "")
        if rolled and created != rolled:
            target = rolled  # a canary beside the rolled-out revision
        elif rolled and before:
            target = before  # promoted already: KServe rolls back to the one before
        else:
            self._deployed.pop(name, None)
            gone = self.kube.delete(INFERENCESERVICE, ns, name)
            print(f"inferenceservice/{name}: deleted (first deployment)", flush=True)
            what = "removed" if gone else "was already gone"
            return f"{ref} {what}: its first deployment, no previous revision to return to"
        return self._restore(ns, name, target, created)

    def delete(self, name: str, run_tag: str = "") -> None:
        """Delete `name`; with `run_tag`, only if that run deployed it (another run's stays)."""
        ns = self._deployed.pop(name, self.namespace)
        if run_tag:
            obj = self.kube.get(INFERENCESERVICE, ns, name)
            if obj is None:
                return
            owner = ((obj.get("metadata") or {}).get("annotations") or {}).get(RUN_TAG_ANNOTATION)
            if owner != run_tag:
                print(f"inferenceservice/{name}: kept, deployed by run {owner!r} not {run_tag!r}")
                return
        if self.kube.delete(INFERENCESERVICE, ns, name):
            print(f"inferenceservice/{name}: deleted", flush=True)

    # ------------------------------------------------------------------ the rollout steps

    def _await_first(
        self, request: ServeRequest, stale: set[str], put_status: dict[str, Any] | None
    ) -> Rollout:
        """Wait for the only revision to take all traffic; delete the service if it does not
        (nothing served before it)."""
        ns, name = request.namespace, request.name

        def done(o: dict[str, Any]) -> bool:
            p = predictor_status(o)
            new = p.get("latestCreatedRevision")
            return bool(
                new
                and new not in stale
                and p.get("latestReadyRevision") == new
                and p.get("latestRolledoutRevision") == new
                and condition_is_true(o, "Ready")
                and _generation_observed(o)
                and _url(o, self.cluster_local)
            )

        seen = self._await(
            ns, name, request.timeout_s, done, self._fresh_failure(stale, put_status)
        )
        if seen.outcome == "done" and seen.obj is not None:
            return Rollout(Endpoint(name, _url(seen.obj, self.cluster_local)))
        self._deployed.pop(name, None)
        fate = "it has been deleted"
        try:
            self.kube.delete(INFERENCESERVICE, ns, name)
        except Exception as e:  # the failure is the news; say what is left behind
            fate = f"deleting it failed ({e}); delete it by hand"
        ref = f"inferenceservice/{name} in {ns}"
        if seen.outcome == "failed":
            raise JobFailed(f"{ref} failed: {seen.why}; {fate}")
        if seen.outcome == "deleted":
            raise JobFailed(f"{ref} was deleted while waited on")
        raise JobTimeout(
            f"{ref} did not become ready within {request.timeout_s:g}s "
            f"(last state: {seen.state}); {fate}"
        )

    def _await_canary(
        self,
        request: ServeRequest,
        previous: str,
        stale: set[str],
        put_status: dict[str, Any] | None,
    ) -> Rollout:
        """Wait for the new revision to be ready with its share; else 0% for it again."""
        ns, name, share = request.namespace, request.name, request.canary_traffic_percent

        def done(o: dict[str, Any]) -> bool:
            p = predictor_status(o)
            new = p.get("latestCreatedRevision")
            if not new or new in stale or p.get("latestReadyRevision") != new:
                return False
            if not (condition_is_true(o, "Ready") and _generation_observed(o)):
                return False
            if share == 100:  # all traffic at once: KServe rolls it out (no canary)
                return bool(p.get("latestRolledoutRevision") == new and _url(o, self.cluster_local))
            latest = _target(o, LATEST_TAG) or {}
            return bool(
                latest.get("revisionName") == new
                and int(latest.get("percent") or 0) == share
                and tag_url(o, LATEST_TAG, self.cluster_local)
            )

        seen = self._await(
            ns, name, request.timeout_s, done, self._fresh_failure(stale, put_status)
        )
        if seen.outcome == "done" and seen.obj is not None:
            new = str(predictor_status(seen.obj).get("latestCreatedRevision"))
            if share == 100:
                return Rollout(Endpoint(name, _url(seen.obj, self.cluster_local)), False, previous)
            url = tag_url(seen.obj, LATEST_TAG, self.cluster_local)
            print(f"inferenceservice/{name}: canary {new} at {url} ({share}%)", flush=True)
            return Rollout(Endpoint(name, url), canary=True, previous=previous)
        ref = f"inferenceservice/{name} in {ns}"
        if seen.outcome == "deleted":
            raise JobFailed(f"{ref} was deleted while its canary was waited on")
        new = str(predictor_status(seen.obj or {}).get("latestCreatedRevision") or "the new one")
        try:
            restored = self._restore(ns, name, previous, new)
        except JobFailed as e:
            restored = f"moving traffic back failed too: {e}"
        if seen.outcome == "failed":
            raise JobFailed(f"{ref}: canary revision {new} failed: {seen.why}; {restored}")
        raise JobTimeout(
            f"{ref}: canary revision {new} did not become ready within "
            f"{request.timeout_s:g}s (last state: {seen.state}); {restored}"
        )

    def _restore(self, ns: str, name: str, target: str, canary: str) -> str:
        """canaryTrafficPercent 0 and wait until `target` has all traffic."""
        current = self._get(ns, name)
        spec = ((current or {}).get("spec") or {}).get("predictor") or {}
        if spec.get("canaryTrafficPercent") != 0:
            self._update(ns, name, lambda o: o["spec"]["predictor"].update(canaryTrafficPercent=0))

        def back(o: dict[str, Any]) -> bool:
            return bool(
                traffic_by_revision(o).get(target) == 100
                and predictor_status(o).get("latestRolledoutRevision") == target
            )

        seen = self._await(ns, name, self.traffic_timeout_s, back, lambda o: None)
        if seen.outcome != "done":
            raise self._traffic_error(ns, name, f"all traffic back to {target}", seen)
        print(f"inferenceservice/{name}: rolled back, {target} takes all traffic", flush=True)
        return f"traffic back on revision {target} (revision {canary} gets 0%)"

    def _fresh_failure(self, stale: set[str], put_status: dict[str, Any] | None) -> Failure:
        """`_blocked`, but not a verdict left from before our update: it counts once it is
        about a new revision, or once KServe has written a status since (InvalidSpec comes
        before any revision)."""

        def failure(o: dict[str, Any]) -> str | None:
            new = predictor_status(o).get("latestCreatedRevision")
            fresh = (new and new not in stale) or o.get("status") != put_status
            return _blocked(o) if fresh else None

        return failure

    def _traffic_error(self, ns: str, name: str, what: str, seen: _Seen) -> JobFailed:
        ref = f"inferenceservice/{name} in {ns}"
        if seen.outcome == "deleted":
            return JobFailed(f"{ref} was deleted while waiting for {what}")
        return JobTimeout(
            f"{ref}: KServe did not report {what} within {self.traffic_timeout_s:g}s "
            f"(last state: {seen.state})"
        )

    # ------------------------------------------------------------------ API calls

    def _get(self, ns: str, name: str) -> dict[str, Any] | None:
        for attempt in range(_UPDATE_ATTEMPTS):
            try:
                return self.kube.get(INFERENCESERVICE, ns, name)
            except ApiException as e:
                if e.status not in TRANSIENT or attempt == _UPDATE_ATTEMPTS - 1:
                    raise JobFailed(
                        f"inferenceservice/{name} in {ns} could not be read: "
                        f"HTTP {e.status} {api_message(e)}"
                    ) from e
                time.sleep(min(self.kube.poll_interval_s, 0.2 * 2**attempt))
        return None  # unreachable

    def _create(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        out = self.kube.create(INFERENCESERVICE, ns, body)
        print(f"inferenceservice/{body['metadata']['name']}: created in {ns}", flush=True)
        return out

    def _update(
        self, ns: str, name: str, change: Callable[[dict[str, Any]], Any]
    ) -> dict[str, Any]:
        """Read, change, replace (the `update` verb, with the read resourceVersion: a write
        in between, e.g. KServe's status, makes it 409 and we read again)."""
        for attempt in range(_UPDATE_ATTEMPTS):
            obj = self._get(ns, name)
            if obj is None:
                raise JobFailed(f"inferenceservice/{name} in {ns} was deleted meanwhile")
            change(obj)
            try:
                out: dict[str, Any] = self.kube.custom.replace_namespaced_custom_object(
                    INFERENCESERVICE.group,
                    INFERENCESERVICE.version,
                    ns,
                    INFERENCESERVICE.plural,
                    name,
                    obj,
                    _request_timeout=self.kube.request_timeout_s,
                )
                return out
            except ApiException as e:
                retry = e.status == 409 or e.status in TRANSIENT
                if not retry or attempt == _UPDATE_ATTEMPTS - 1:
                    raise JobFailed(
                        f"inferenceservice/{name} in {ns} was not updated: "
                        f"HTTP {e.status} {api_message(e)}"
                    ) from e
        raise AssertionError("unreachable")

    @staticmethod
    def _apply(obj: dict[str, Any], body: dict[str, Any]) -> None:
        """`obj` (as read) with the spec, labels and annotations of `body`; annotations and
        labels of others are kept."""
        obj["spec"] = copy.deepcopy(body["spec"])
        meta, want = obj.setdefault("metadata", {}), body["metadata"]
        annotations = {**(meta.get("annotations") or {}), **(want.get("annotations") or {})}
        for key in (RUN_TAG_ANNOTATION, MODEL_VERSION_ANNOTATION):
            if key not in (want.get("annotations") or {}):
                annotations.pop(key, None)
        meta["annotations"] = annotations
        meta["labels"] = {**(meta.get("labels") or {}), **(want.get("labels") or {})}

    def _same_template(self, current: dict[str, Any], body: dict[str, Any]) -> bool:
        """Whether `body` would leave the revision template as it is (no new revision):
        KServe builds it from the predictor (canaryTrafficPercent goes to the route only)
        and the InferenceService's labels and annotations (components/predictor.go)."""
        after = copy.deepcopy(current)
        self._apply(after, body)
        meta, now = after["metadata"], current.get("metadata") or {}
        same_meta = meta.get("annotations") == (now.get("annotations") or {}) and meta.get(
            "labels"
        ) == (now.get("labels") or {})
        have = _without_canary(((current.get("spec") or {}).get("predictor")) or {})
        want = _without_canary(body["spec"]["predictor"])
        return same_meta and _contains(have, want)

    def _await(self, ns: str, name: str, timeout_s: float, done: Check, failure: Failure) -> _Seen:
        """Watch the InferenceService until `done`, `failure`, its deletion or the timeout,
        printing each new state. Unlike KubeClient.wait, a timeout deletes nothing: what to
        do is the caller's (a canary's timeout must leave the serving revision alone)."""
        deadline = time.monotonic() + timeout_s
        shown, state, last = None, "never read", None
        for obj in self.kube.watch_object(INFERENCESERVICE, ns, name, deadline):
            if obj is None:
                return _Seen("deleted", last, state)
            last, state = obj, describe(obj)
            if state != shown:
                print(f"inferenceservice/{name}: {state}", flush=True)
                shown = state
            if done(obj):
                return _Seen("done", obj, state)
            why = failure(obj)
            if why is not None:
                return _Seen("failed", obj, state, why)
        return _Seen("timeout", last, state)

    # ------------------------------------------------------------------ end of a run

    def release_unpromoted(self, run_tag: str, champion: str | None) -> list[str]:
        """Server.release_unpromoted for every InferenceService in `namespace` whose last
        deployment was run `run_tag`'s (its kubellm/run-tag annotation; the run label
        can be missing on one an older kubellm made):

        - the champion's version (kubellm/model-version == `champion`) is kept as it is;
        - a canary beside a serving revision gives its traffic back (`rollback`): it was
          never promoted, the smoke test promotes before it names a champion;
        - with the champion unknown (None), one that serves is kept: it may be the champion;
        - any other is rolled back to the revision before it, or, when none served before
          it (a first deployment that failed or was never promoted), deleted (`rollback`).
        """
        ns = self.namespace
        selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        try:
            items = self.kube.list(INFERENCESERVICE, ns, selector)
        except ApiException as e:
            if e.status == 404:  # KServe is not installed: nothing was deployed
                return []
            return [
                f"inferenceservices in {ns} could not be listed (HTTP {e.status} "
                f"{api_message(e)}); check those of run {run_tag} by hand"
            ]
        done = []
        for obj in items:
            meta = obj.get("metadata") or {}
            if (meta.get("annotations") or {}).get(RUN_TAG_ANNOTATION) != run_tag:
                continue
            ref = f"inferenceservice/{meta.get('name')} in {ns}"
            try:
                said = self._release_one(obj, run_tag, champion)
            except (JobFailed, ApiException) as e:
                said = f"{ref}: {e}; check it by hand"
            done.append(said if said.startswith("inferenceservice/") else f"{ref}: {said}")
        return done

    def _release_one(self, obj: dict[str, Any], run_tag: str, champion: str | None) -> str:
        meta = obj["metadata"]
        name = str(meta["name"])
        ref = f"inferenceservice/{name} in {self.namespace}"
        version = str((meta.get("annotations") or {}).get(MODEL_VERSION_ANNOTATION) or "")
        serving = serving_revision(obj)
        created = str(predictor_status(obj).get("latestCreatedRevision") or "")
        canary = bool(serving) and created != serving
        if champion is not None and version and version == champion:
            return f"{ref} kept: it serves version {version}, the champion"
        if champion is None and serving and not canary:
            return (
                f"{ref} kept: it serves revision {serving} and the model registry could not "
                f"say whether version {version or '?'} is the champion"
            )
        return self.rollback(name, run_tag, self.namespace)
