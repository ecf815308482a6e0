"""Serve a model on KServe (v1beta1 InferenceService), rolled out as a canary where a
previous version serves.

Two runtimes; both answer the OpenAI routes (/openai/v1) the smoke test calls, only `custom`
also KServe's V1/V2 (the Hugging Face runtime's models are not InferenceModels):

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

Both KServe deployment modes (InferenceServiceServer._mode decides, before anything changes:
the service's status, its annotation, the configured default):

- Knative ("Serverless", the default of KServe's shipped config/configmap/inferenceservice.yaml):
  the revisions and canaryTrafficPercent above. The predictor's pod spec becomes a Knative
  Service's, which Knative's field masks check: the non-root identity is therefore set on the
  container, never on the pod (knative/serving pkg/apis/serving/fieldmask.go).
- Standard (RawDeployment): a Deployment per predictor, status from the Deployment
  (inference_service_status.go PropagateRawStatus: no revisions, no traffic). A new version
  goes out as a `spec.canary` entry (KServe >= 0.20) with its own Deployment and Service;
  promote moves it into spec.predictor (no restart), rollback removes it. Where the server
  has no spec.canary, the new version replaces the old in place (a full rollout) and
  rollback restores the old (the `kubellm/previous` annotation keeps it).

A service another run deployed (its kubellm/run-tag) is never replaced or deleted.

Example (a cluster with KServe):

    InferenceServiceServer().deploy(ServeRequest(name="llm", namespace="team-a",
        model_uri="pvc://kubellm-workspace/serve/v3", version="3"))
"""

from __future__ import annotations

import copy
import hashlib
import json
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
from kubellm.backends.kubernetes.podspec import MANAGED_BY, RUN_LABEL, label_value, toleration
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
# constants.go InferenceServicePodLabelKey: on every predictor pod, with `component`.
ISVC_POD_LABEL = "serving.kserve.io/inferenceservice"
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
# KServe's deployment modes (constants.go DeploymentModeType) and where the mode is set:
# the InferenceService's annotation, else `deploy` -> `defaultDeploymentMode` of the
# inferenceservice-config ConfigMap in KServe's namespace (constants.go KServeNamespace).
KNATIVE, STANDARD, MODELMESH = "Knative", "Standard", "ModelMesh"
DEPLOYMENT_MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
KSERVE_NAMESPACE = "kserve"
KSERVE_CONFIG = "inferenceservice-config"
# Standard mode keeps no revisions: what served before a full rollout, for its rollback
# ({"predictor": ..., "annotations": {run tag, model version}}, JSON).
PREVIOUS_ANNOTATION = "kubellm/previous"
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


# Labels that keep a service off the public ingress (ServeRequest.cluster_local). Knative mode:
# constants.go VisibilityLabel, which KServe copies to the Knative Service (ksvc_reconciler.go;
# RevisionTemplateLabelDisallowedList keeps it off the revision), whose route and every tag
# route then live on the cluster-local domain only (Knative's private services), and
# ingress_reconciler.go makes no external host. Standard mode: constants.go NetworkVisibility
# (kube_ingress_reconciler.go, httproute_reconciler.go: no Ingress / HTTPRoute host).
CLUSTER_LOCAL = "cluster-local"  # constants.go ClusterLocalVisibility
KNATIVE_VISIBILITY_LABEL = "networking.knative.dev/visibility"
KSERVE_VISIBILITY_LABEL = "networking.kserve.io/visibility"
# What `kubellm serve` loads: the checkpoint as it is (kubellm.config.CHECKPOINT_DTYPE); it
# has no --dtype or --max_model_len.
CUSTOM_DTYPES = ("", "float32")
# python/huggingfaceserver/huggingfaceserver/__main__.py dtype_choices: another value exits
# the runtime at start (argparse), which the deploy would only see as a pod never ready.
HF_DTYPES = ("auto", "float16", "float32", "bfloat16", "float", "half")


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
    # --dtype and --max_model_len are flags of both backends (huggingfaceserver's own parser,
    # vLLM's EngineArgs). Without --dtype a GPU serves a float32 checkpoint in half precision
    # (vLLM's auto; the HF backend's default_dtype float16), not what evaluate measured.
    if request.dtype:
        if request.dtype not in HF_DTYPES:
            raise ValueError(
                f"ServeRequest {request.name!r}: dtype {request.dtype!r} is not one of the "
                f"Hugging Face runtime's ({', '.join(HF_DTYPES)})"
            )
        args.append(f"--dtype={request.dtype}")
    if request.max_model_len > 0:
        args.append(f"--max_model_len={request.max_model_len}")
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
    if request.dtype not in CUSTOM_DTYPES or request.max_model_len > 0:
        raise ValueError(
            f"ServeRequest {request.name!r}: runtime 'custom' (`kubellm serve`) loads the "
            "checkpoint as it is, float32 and the model's own context: dtype "
            f"{request.dtype!r} / max_model_len {request.max_model_len} need runtime "
            "'huggingface'"
        )
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


def _identity(uid: int) -> dict[str, Any]:
    """Non-root as `uid`, the image's own user (the Pod Security "restricted" profile), as
    container-level fields: Knative's PodSpecMask drops a pod-level securityContext unless
    `kubernetes.podspec-securitycontext` is enabled (off by default), and never admits
    fsGroupChangePolicy (knative/serving pkg/apis/serving/fieldmask.go PodSpecMask,
    PodSecurityContextMask at knative-v1.21.1, the version KServe 0.20 builds against); its
    SecurityContextMask admits these on the container. The same body serves Standard mode."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _secure(predictor: dict[str, Any], uid: int) -> None:
    """The identity on the serving container (the model or the custom container), beside
    what it already sets (no privilege escalation, no capabilities, read-only root)."""
    containers = [predictor["model"]] if predictor.get("model") else predictor["containers"]
    for container in containers:
        container["securityContext"] = {
            **(container.get("securityContext") or {}),
            **_identity(uid),
        }


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
        # The model server never calls the Kubernetes API: no token in the pod.
        automount_service_account_token=False,
        # The account whose secrets KServe's storage initializer takes the storage
        # credentials from (credentials/service_account_credentials.go; "": `default`).
        service_account_name=request.service_account or None,
        node_selector=dict(res.node_selector) or None,
        tolerations=[toleration(t) for t in res.tolerations] or None,
    )
    annotations = {TAG_ROUTING_ANNOTATION: "true"}
    labels = dict(MANAGED_BY)
    if request.cluster_local:
        labels[KNATIVE_VISIBILITY_LABEL] = CLUSTER_LOCAL
        labels[KSERVE_VISIBILITY_LABEL] = CLUSTER_LOCAL
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
    _secure(out["spec"]["predictor"], HF_RUNTIME_UID if hf else RUN_AS_UID)
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


def parse_mode(value: str) -> str:
    """constants.go ParseDeploymentMode: the legacy names (Serverless, RawDeployment) as the
    current ones; `""` stays unknown."""
    return {"Serverless": KNATIVE, "RawDeployment": STANDARD}.get(value, value)


def recorded_mode(obj: dict[str, Any]) -> str:
    """The mode KServe runs `obj` in, as utils.go GetDeploymentMode reads it: the one its
    status recorded, else a valid annotation; `""` when neither says (then the cluster's
    default applies: InferenceServiceServer._mode)."""
    status = str((obj.get("status") or {}).get("deploymentMode") or "")
    if status:
        return parse_mode(status)
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    mode = parse_mode(str(annotations.get(DEPLOYMENT_MODE_ANNOTATION) or ""))
    return mode if mode in (KNATIVE, STANDARD, MODELMESH) else ""


def _annotations(obj: dict[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("annotations") or {})


def deployed_by(obj: dict[str, Any]) -> str:
    """The run whose deployment `obj` serves: the predictor's kubellm/run-tag (a Standard
    mode canary promoted in place carries it there), else the InferenceService's."""
    predictor = (obj.get("spec") or {}).get("predictor") or {}
    own = (predictor.get("annotations") or {}).get(RUN_TAG_ANNOTATION)
    return str(own or _annotations(obj).get(RUN_TAG_ANNOTATION) or "")


def served_version(obj: dict[str, Any]) -> str:
    predictor = (obj.get("spec") or {}).get("predictor") or {}
    own = (predictor.get("annotations") or {}).get(MODEL_VERSION_ANNOTATION)
    return str(own or _annotations(obj).get(MODEL_VERSION_ANNOTATION) or "")


def standard_serves(obj: dict[str, Any]) -> bool:
    """Standard mode: the predictor's Deployment is available and has an address
    (inference_service_status.go PropagateRawStatus sets components.predictor.url only then);
    there are no revisions or traffic targets."""
    return condition_is_true(obj, "PredictorReady") and bool(predictor_status(obj).get("url"))


def predictor_service(isvc: str, predictor_name: str = "") -> str:
    """constants.go PredictorServiceName: the Deployment and Service of a predictor."""
    return f"{isvc}-{predictor_name}-predictor" if predictor_name else f"{isvc}-predictor"


def canary_entry(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The (only) spec.canary entry kubellm writes, Standard mode with KServe >= 0.20."""
    entries = (obj.get("spec") or {}).get("canary") or []
    return dict(entries[0]) if entries else None


def canary_ready(obj: dict[str, Any], name: str) -> bool:
    """status.canaryStatuses: predictor.go reconcileCanaryDeployments marks a canary ready
    once its Deployment has an available replica."""
    for cs in (obj.get("status") or {}).get("canaryStatuses") or []:
        if cs.get("name") == name:
            return bool(cs.get("ready"))
    return False


def _denied(obj: dict[str, Any]) -> str | None:
    """PredictorReady False ReconcileFailed with an admission webhook's denial: the Knative
    Service (or Deployment) KServe built was refused, and will be on every retry until the
    spec changes (components/predictor.go PropagateRawStatusWithMessages with the error of
    the create or update)."""
    cond = find_condition(obj, "PredictorReady") or {}
    message = str(cond.get("message") or "")
    refused = str(cond.get("status")) == "False" and cond.get("reason") == "ReconcileFailed"
    return f"ReconcileFailed: {message}" if refused and "denied the request" in message else None


def serving_revision(obj: dict[str, Any]) -> str:
    """The last revision rolled out to all traffic, if it still takes some: what serves
    while a canary is tried. `""` when none (a first deployment, or one never ready)."""
    rolled = str(predictor_status(obj).get("latestRolledoutRevision") or "")
    return rolled if rolled and traffic_by_revision(obj).get(rolled, 0) > 0 else ""


def _owner_annotations(body: dict[str, Any]) -> dict[str, str]:
    annotations = body["metadata"].get("annotations") or {}
    return {
        k: v for k, v in annotations.items() if k in (RUN_TAG_ANNOTATION, MODEL_VERSION_ANNOTATION)
    }


def standard_canary(
    request: ServeRequest, body: dict[str, Any], current: dict[str, Any]
) -> dict[str, Any]:
    """The spec.canary entry for `body`'s predictor (KServe 0.20 inference_service.go
    CanarySpec: `predictor` with a required `name`, `trafficPercent` 0..100).

    - the name is `v<version>-<digest of the predictor>`: it names the canary's Deployment
      and Service (`<isvc>-<name>-predictor`, constants.go PredictorServiceName), and
      promotion keeps it (KServe's documented promotion without restart: predictor.name set
      to the canary's, the entry removed);
    - no maxReplicas and no minReplicas: inference_service_validation.go validateCanarySpecs
      refuses autoscaling fields, and KServe sizes a canary by its share
      (predictor.go canaryReplicaCount);
    - the run and version annotations and what serves now (for a rollback after promotion)
      go on the canary's predictor, so its pods carry them and the stable predictor's pods
      stay as they are (InferenceService annotations reach every predictor's pod template:
      predictor.go buildObjectMeta).
    """
    predictor = copy.deepcopy(body["spec"]["predictor"])
    for key in ("minReplicas", "maxReplicas", "canaryTrafficPercent"):
        predictor.pop(key, None)
    if predictor.get("model"):
        # the CRD requires the container name in a canary's model (validatePredictor's
        # refusal of one applies to spec.predictor only); promotion takes it out again
        predictor["model"]["name"] = CONTAINER
    stable = current["spec"]["predictor"]
    before = {
        "predictor": {
            **stable,
            "annotations": {
                k: v
                for k, v in (stable.get("annotations") or {}).items()
                if k != PREVIOUS_ANNOTATION
            },
        },
        "annotations": _owner_annotations(current)
        if not (stable.get("annotations") or {}).get(RUN_TAG_ANNOTATION)
        else {},
    }
    predictor["annotations"] = {
        **(predictor.get("annotations") or {}),
        **_owner_annotations(body),
        PREVIOUS_ANNOTATION: json.dumps(before, sort_keys=True),
    }
    digest = hashlib.sha256(json.dumps(predictor, sort_keys=True).encode()).hexdigest()[:6]
    version = re.sub(r"[^a-z0-9-]+", "-", request.version.lower()).strip("-")[:12]
    predictor["name"] = f"v{version}-{digest}" if version else f"r{digest}"
    return {"predictor": predictor, "trafficPercent": request.canary_traffic_percent}


def entry_annotation(entry: dict[str, Any] | None, key: str) -> str:
    """An annotation of a spec.canary entry's predictor (its run, its version)."""
    return str(((entry or {}).get("predictor") or {}).get("annotations", {}).get(key) or "")


def _put_canary(obj: dict[str, Any], entry: dict[str, Any]) -> None:
    """spec.canary = [entry], with the mode annotation validateCanarySpecs requires
    (`Standard`; KServe's defaulter writes it at create where Standard is the default, and
    validateDeploymentMode admits it where the status says Standard)."""
    obj["spec"]["canary"] = [copy.deepcopy(entry)]
    obj["metadata"].setdefault("annotations", {})[DEPLOYMENT_MODE_ANNOTATION] = STANDARD


def previous_record(obj: dict[str, Any]) -> dict[str, Any] | None:
    """What served before the version `obj` serves, in Standard mode: on the predictor (a
    promoted canary) or on the InferenceService (a full rollout)."""
    predictor = (obj.get("spec") or {}).get("predictor") or {}
    raw = (predictor.get("annotations") or {}).get(PREVIOUS_ANNOTATION) or _annotations(obj).get(
        PREVIOUS_ANNOTATION
    )
    try:
        return dict(json.loads(raw)) if raw else None
    except ValueError:
        return None


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
    `service_url(namespace, service)` is the address of a Service (a Standard mode canary's
    own, which KServe's status does not report); by default its cluster DNS name.
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
        service_url: Callable[[str, str], str] | None = None,
    ) -> None:
        self.kube = KubeClient(api_client, poll_interval_s, request_timeout_s)
        self.namespace = namespace
        self.cluster_local = cluster_local
        self.traffic_timeout_s = traffic_timeout_s
        self.service_url = service_url or (lambda ns, svc: f"http://{svc}.{ns}.svc.cluster.local")
        self._deployed: dict[str, str] = {}  # name -> namespace, so later calls find our own

    # ------------------------------------------------------------------ Server

    def deploy(self, request: ServeRequest) -> Rollout:
        """Create the service, or roll the new version out beside the one that serves.

        First deployment (or one of this run where nothing serves): all traffic,
        Rollout(canary=False) with the service's address; if it never becomes ready it is
        deleted (while it is still this run's) and JobFailed (JobTimeout) says why. Where a
        version serves, by KServe's mode (`_mode`, decided before anything changes):

        - Knative: an update with canaryTrafficPercent; Rollout(canary=True,
          previous=<that revision>) with the new revision's own address. A canary that never
          becomes ready gets 0% again; the previous revision serves throughout.
        - Standard: a `spec.canary` entry beside the stable predictor (KServe >= 0.20);
          where the server has no spec.canary, a full rollout in place
          (Rollout(full_rollout=True)), which a rollback undoes.

        A service another run deployed and that serves nothing is never replaced.
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
        mode = self._mode(current)
        if mode == STANDARD:
            return self._deploy_standard(request, current, body)
        if mode not in (KNATIVE, ""):
            raise JobFailed(
                f"inferenceservice/{name} in {ns} runs in KServe's {mode} deployment mode, "
                "which kubellm does not deploy to; nothing was changed"
            )
        previous = serving_revision(current)
        same = self._same_template(current, body)
        pred = predictor_status(current)
        created = str(pred.get("latestCreatedRevision") or "")
        if not previous:  # nothing serves: replacing it takes nothing away, if it is ours
            self._refuse_foreign(current, request)
            updated = self._update(ns, name, lambda o: self._apply(o, body))
            stale = set() if same else {created}
            return self._await_first(request, stale, updated.get("status"))
        if same and created == previous:
            print(f"inferenceservice/{name}: this version already serves ({previous})", flush=True)
            return Rollout(Endpoint(name, _url(current, self.cluster_local)), mode=KNATIVE)
        canary = build_inferenceservice(request, canary=True)
        updated = self._update(ns, name, lambda o: self._apply(o, canary))
        stale = {previous} if same else {previous, created}
        return self._await_canary(request, previous, stale, updated.get("status"))

    # ------------------------------------------------------------------ the mode

    def _mode(self, current: dict[str, Any]) -> str:
        """The one place that decides KServe's mode for an existing InferenceService:
        utils.go GetDeploymentMode's order (its status, its annotation, the configured
        default). `""` when none can be read."""
        return recorded_mode(current) or self._default_mode()

    def _default_mode(self) -> str:
        """`deploy.defaultDeploymentMode` of ConfigMap kserve/inferenceservice-config
        (configmap.go NewDeployConfig); `""` when it cannot be read (the pipeline's Role
        may not reach KServe's namespace), which is said."""
        try:
            cm = self.kube.core.read_namespaced_config_map(
                KSERVE_CONFIG, KSERVE_NAMESPACE, _request_timeout=self.kube.request_timeout_s
            )
            deploy = json.loads(((cm.data or {}).get("deploy")) or "{}")
            return parse_mode(str(deploy.get("defaultDeploymentMode") or ""))
        except (ApiException, ValueError) as e:
            why = f"HTTP {e.status} {api_message(e)}" if isinstance(e, ApiException) else str(e)
            print(
                f"configmap/{KSERVE_CONFIG} in {KSERVE_NAMESPACE} could not be read ({why}): "
                "KServe's default deployment mode is unknown",
                flush=True,
            )
            return ""

    def _refuse_foreign(self, current: dict[str, Any], request: ServeRequest) -> None:
        """Never replace what another run deployed (kubellm/run-tag), even if it serves
        nothing yet: it may be that run's first deployment, still starting."""
        owner = deployed_by(current)
        if owner and owner != request.run_tag:
            raise JobFailed(
                f"inferenceservice/{request.name} in {request.namespace} was deployed by run "
                f"{owner!r} and serves nothing yet; it was left as it is (wait for that run, "
                "or delete it)"
            )

    # ------------------------------------------------------------------ Standard mode

    def _deploy_standard(
        self, request: ServeRequest, current: dict[str, Any], body: dict[str, Any]
    ) -> Rollout:
        """Standard (RawDeployment) mode: a Deployment per predictor, no revisions."""
        ns, name = request.namespace, request.name
        if not standard_serves(current):
            self._refuse_foreign(current, request)
            updated = self._update(ns, name, lambda o: self._apply(o, body))
            return self._await_first(request, set(), updated.get("status"))
        stable = predictor_service(name, str(current["spec"]["predictor"].get("name") or ""))
        if self._same_template(current, body) and canary_entry(current) is None:
            print(f"inferenceservice/{name}: this version already serves ({stable})", flush=True)
            return Rollout(Endpoint(name, _url(current, self.cluster_local)), mode=STANDARD)
        entry = standard_canary(request, body, current)
        try:
            updated = self._update(ns, name, lambda o: _put_canary(o, entry))
        except JobFailed as e:
            if "spec.canary" not in str(e) or "unknown field" not in str(e):
                raise
            updated = {}  # a strict server names the field it does not know
        if canary_entry(updated) is None:  # pruned: this KServe has no spec.canary (< 0.20)
            return self._full_rollout(request, current, body, stable)
        return self._await_standard_canary(request, entry, stable, updated.get("status"))

    def _await_standard_canary(
        self,
        request: ServeRequest,
        entry: dict[str, Any],
        stable: str,
        put_status: dict[str, Any] | None,
    ) -> Rollout:
        """Wait for the canary's Deployment to be available (status.canaryStatuses); else
        remove the entry: the stable predictor serves throughout."""
        ns, name = request.namespace, request.name
        canary = entry["predictor"]["name"]

        def done(o: dict[str, Any]) -> bool:
            return canary_ready(o, canary) and condition_is_true(o, "CanaryPredictorReady")

        seen = self._await(
            ns, name, request.timeout_s, done, self._fresh_failure(set(), put_status)
        )
        if seen.outcome == "done":
            url = self.service_url(ns, predictor_service(name, canary))
            share = entry["trafficPercent"]
            print(f"inferenceservice/{name}: canary {canary} at {url} ({share}%)", flush=True)
            return Rollout(Endpoint(name, url), canary=True, previous=stable, mode=STANDARD)
        ref = f"inferenceservice/{name} in {ns}"
        if seen.outcome == "deleted":
            raise JobFailed(f"{ref} was deleted while its canary was waited on")
        try:
            restored = self._drop_canary(ns, name, stable)
        except JobFailed as e:
            restored = f"removing the canary failed too: {e}"
        if seen.outcome == "failed":
            raise JobFailed(f"{ref}: canary {canary} failed: {seen.why}; {restored}")
        raise JobTimeout(
            f"{ref}: canary {canary} did not become ready within {request.timeout_s:g}s "
            f"(last state: {seen.state}); {restored}"
        )

    def _drop_canary(self, ns: str, name: str, stable: str) -> str:
        """Remove spec.canary: KServe routes all traffic to the stable predictor again and
        deletes the canary's Deployment (reconcileCanaryDeployments' orphan cleanup)."""
        self._update(ns, name, lambda o: o["spec"].pop("canary", None))

        def gone(o: dict[str, Any]) -> bool:
            return not (o.get("status") or {}).get("canaryStatuses") and standard_serves(o)

        seen = self._await(ns, name, self.traffic_timeout_s, gone, lambda o: None)
        if seen.outcome != "done":
            raise self._traffic_error(ns, name, "the canary removed", seen)
        print(f"inferenceservice/{name}: canary removed, {stable} takes all traffic", flush=True)
        return f"canary removed, {stable} serves all traffic"

    def _full_rollout(
        self, request: ServeRequest, current: dict[str, Any], body: dict[str, Any], stable: str
    ) -> Rollout:
        """No spec.canary on this server: replace the predictor in place (its Deployment
        rolls, the old pods serve until the new are ready), remembering what served for a
        rollback; the smoke test then checks the new pods, which take all traffic."""
        ns, name = request.namespace, request.name
        before = served_version(current) or stable
        print(
            f"inferenceservice/{name}: KServe Standard mode without spec.canary (< 0.20): "
            f"no canary; a full rollout replaces {before}, a rollback restores it",
            flush=True,
        )
        previous = json.dumps(
            {
                "predictor": current["spec"]["predictor"],
                "annotations": {
                    k: v
                    for k, v in _annotations(current).items()
                    if k in (RUN_TAG_ANNOTATION, MODEL_VERSION_ANNOTATION)
                },
            },
            sort_keys=True,
        )
        rolled = copy.deepcopy(body)
        rolled["metadata"]["annotations"][PREVIOUS_ANNOTATION] = previous
        updated = self._update(ns, name, lambda o: self._apply(o, rolled))
        rollout = self._await_first(
            request, set(), updated.get("status"), lambda: self._restore_standard(ns, name)
        )
        return Rollout(rollout.endpoint, previous=before, mode=STANDARD, full_rollout=True)

    def _restore_standard(self, ns: str, name: str) -> str:
        """Put back what served before (previous_record): its predictor, under the current
        predictor name (the same Deployment rolls back, its pods serve until replaced), and
        its run and version annotations."""
        current = self._get(ns, name)
        record = previous_record(current or {})
        if current is None or record is None:
            raise JobFailed(f"inferenceservice/{name} in {ns}: nothing served before it")

        def change(o: dict[str, Any]) -> None:
            predictor = copy.deepcopy(record["predictor"])
            keep = o["spec"]["predictor"].get("name")
            predictor.pop("name", None)
            if keep:
                predictor["name"] = keep
            o["spec"]["predictor"] = predictor
            o["spec"].pop("canary", None)
            annotations = o["metadata"].setdefault("annotations", {})
            annotations.pop(PREVIOUS_ANNOTATION, None)
            for key in (RUN_TAG_ANNOTATION, MODEL_VERSION_ANNOTATION):
                annotations.pop(key, None)
            annotations.update(record.get("annotations") or {})

        self._update(ns, name, change)
        owner = {**(record["predictor"].get("annotations") or {}), **record.get("annotations", {})}
        version = str(owner.get(MODEL_VERSION_ANNOTATION) or "")
        run_tag = str(owner.get(RUN_TAG_ANNOTATION) or "")

        def back(o: dict[str, Any]) -> bool:  # the pods say when the old version is back
            ready = standard_serves(o) and condition_is_true(o, "Ready")
            return ready and self._pods_serve(ns, name, run_tag, version)

        seen = self._await(ns, name, self.traffic_timeout_s, back, lambda o: None)
        if seen.outcome != "done":
            raise self._traffic_error(ns, name, "the previous version back", seen)
        what = f"version {version}" if version else "the previous predictor"
        print(f"inferenceservice/{name}: rolled back, {what} serves (full rollout)", flush=True)
        return f"{what} restored by a full rollout"

    def promote(self, name: str, namespace: str = "") -> Endpoint:
        """All traffic to the latest ready revision (KServe's promotion: no
        canaryTrafficPercent); returns the service's address once KServe reports it rolled
        out. JobFailed when the latest revision is not ready (traffic is left alone)."""
        ns = namespace or self._deployed.get(name, self.namespace)
        obj = self._get(ns, name)
        if obj is None:
            raise JobFailed(f"inferenceservice/{name} in {ns} not found: nothing to promote")
        if recorded_mode(obj) == STANDARD:
            return self._promote_standard(ns, name, obj)
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
        entry = canary_entry(obj)
        owner = entry_annotation(entry, RUN_TAG_ANNOTATION) if entry else deployed_by(obj)
        if run_tag and owner != run_tag:
            return f"{ref} kept as it is: run {owner!r} deployed it, not {run_tag!r}"
        if recorded_mode(obj) == STANDARD:
            return self._rollback_standard(ns, name, obj)
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

    def _promote_standard(self, ns: str, name: str, obj: dict[str, Any]) -> Endpoint:
        """KServe's promotion without restart: predictor.name (and the predictor) set to
        the canary's, the entry removed; the canary's Deployment becomes the stable one and
        the old one is deleted (reconcileCanaryDeployments). After a full rollout there is
        nothing to move: the new version has all traffic."""
        entry = canary_entry(obj)
        ref = f"inferenceservice/{name} in {ns}"
        if entry is None:
            if not standard_serves(obj):
                raise JobFailed(f"{ref} is not ready, nothing to promote ({describe(obj)})")
            print(f"inferenceservice/{name}: serves all traffic already (full rollout)")
            return Endpoint(name, _url(obj, self.cluster_local))
        canary = str(entry["predictor"]["name"])
        if not canary_ready(obj, canary):
            raise JobFailed(
                f"{ref}: canary {canary} is not ready, nothing to promote; traffic unchanged"
            )

        def change(o: dict[str, Any]) -> None:
            now = canary_entry(o) or entry
            stable = o["spec"]["predictor"]
            promoted = copy.deepcopy(now["predictor"])
            (promoted.get("model") or {}).pop("name", None)
            for key in ("minReplicas", "maxReplicas"):
                if key in stable:
                    promoted[key] = stable[key]
            o["spec"]["predictor"] = promoted
            o["spec"].pop("canary", None)

        put = self._update(ns, name, change).get("status")

        def promoted(o: dict[str, Any]) -> bool:
            return (
                o.get("status") != put
                and not (o.get("status") or {}).get("canaryStatuses")
                and standard_serves(o)
                and condition_is_true(o, "Ready")
                and bool(_url(o, self.cluster_local))
            )

        seen = self._await(ns, name, self.traffic_timeout_s, promoted, lambda o: None)
        if seen.outcome != "done" or seen.obj is None:
            raise self._traffic_error(ns, name, f"canary {canary} to all traffic", seen)
        print(f"inferenceservice/{name}: {canary} takes all traffic (promoted in place)")
        return Endpoint(name, _url(seen.obj, self.cluster_local))

    def _rollback_standard(self, ns: str, name: str, obj: dict[str, Any]) -> str:
        """A canary: its entry removed (the stable predictor never changed). Promoted or
        rolled out in full: what served before put back. A first deployment: deleted."""
        ref = f"inferenceservice/{name} in {ns}"
        stable = predictor_service(name, str(obj["spec"]["predictor"].get("name") or ""))
        if canary_entry(obj) is not None:
            return self._drop_canary(ns, name, stable)
        if previous_record(obj) is not None:
            return self._restore_standard(ns, name)
        self._deployed.pop(name, None)
        gone = self.kube.delete(INFERENCESERVICE, ns, name)
        print(f"inferenceservice/{name}: deleted (first deployment)", flush=True)
        what = "removed" if gone else "was already gone"
        return f"{ref} {what}: its first deployment, no previous version to return to"

    def delete(self, name: str, run_tag: str = "") -> None:
        """Delete `name`; with `run_tag`, only if that run deployed it (another run's stays)."""
        ns = self._deployed.pop(name, self.namespace)
        if run_tag:
            obj = self.kube.get(INFERENCESERVICE, ns, name)
            if obj is None:
                return
            owner = deployed_by(obj)
            if owner != run_tag:
                print(f"inferenceservice/{name}: kept, deployed by run {owner!r} not {run_tag!r}")
                return
        if self.kube.delete(INFERENCESERVICE, ns, name):
            print(f"inferenceservice/{name}: deleted", flush=True)

    # ------------------------------------------------------------------ the rollout steps

    def _await_first(
        self,
        request: ServeRequest,
        stale: set[str],
        put_status: dict[str, Any] | None,
        on_failure: Callable[[], str] | None = None,
    ) -> Rollout:
        """Wait for the service to take all traffic with this version, in the mode KServe
        recorded for it; else `on_failure()` (by default: delete the service while it is
        still this run's, since nothing served before it) and JobFailed says what."""
        ns, name = request.namespace, request.name

        def done(o: dict[str, Any]) -> bool:
            if recorded_mode(o) == STANDARD:
                return self._standard_done(o, request, put_status)
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
            mode = recorded_mode(seen.obj) or KNATIVE
            return Rollout(Endpoint(name, _url(seen.obj, self.cluster_local)), mode=mode)
        ref = f"inferenceservice/{name} in {ns}"
        if seen.outcome == "deleted":
            self._deployed.pop(name, None)
            raise JobFailed(f"{ref} was deleted while waited on")
        try:
            fate = on_failure() if on_failure else self._remove_own(ns, name, request.run_tag)
        except Exception as e:  # the failure is the news; say what is left behind
            fate = f"cleaning up failed ({e}); check it by hand"
        if seen.outcome == "failed":
            raise JobFailed(f"{ref} failed: {seen.why}; {fate}")
        raise JobTimeout(
            f"{ref} did not become ready within {request.timeout_s:g}s "
            f"(last state: {seen.state}); {fate}"
        )

    def _remove_own(self, ns: str, name: str, run_tag: str) -> str:
        """Delete a first deployment that never served, unless another run has deployed
        over it meanwhile (its kubellm/run-tag)."""
        self._deployed.pop(name, None)
        current = self._get(ns, name)
        if current is None:
            return "it is gone"
        owner = deployed_by(current)
        if run_tag and owner != run_tag:
            return f"it was kept: run {owner!r} has deployed it since"
        self.kube.delete(INFERENCESERVICE, ns, name)
        return "it has been deleted"

    def _standard_done(
        self, obj: dict[str, Any], request: ServeRequest, put_status: dict[str, Any] | None
    ) -> bool:
        """Standard mode: Ready with an address (PropagateRawStatus), in a status written
        since our change, and every predictor pod is one of this version. KServe keeps
        Ready (and modelStatus Loaded) while the old pods of a rolling Deployment serve, so
        only the pods say when the new version has all traffic."""
        if put_status is not None and obj.get("status") == put_status:
            return False
        if not (condition_is_true(obj, "Ready") and _url(obj, self.cluster_local)):
            return False
        return self._pods_serve(request.namespace, request.name, request.run_tag, request.version)

    def _pods_serve(self, ns: str, name: str, run_tag: str, version: str) -> bool:
        """Every predictor pod is ready and carries this deployment's run and version (the
        InferenceService's annotations reach its pods: predictor.go buildObjectMeta)."""
        pods = self.kube.core.list_namespaced_pod(
            ns,
            label_selector=f"{ISVC_POD_LABEL}={name},component=predictor",
            _request_timeout=self.kube.request_timeout_s,
        ).items
        want = {RUN_TAG_ANNOTATION: run_tag, MODEL_VERSION_ANNOTATION: version}
        for pod in pods:
            annotations = pod.metadata.annotations or {}
            if pod.metadata.deletion_timestamp or any(
                v and annotations.get(k) != v for k, v in want.items()
            ):
                return False
            conditions = (pod.status.conditions if pod.status else None) or []
            if not any(c.type == "Ready" and c.status == "True" for c in conditions):
                return False
        return bool(pods)

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
            return (_blocked(o) or _denied(o)) if fresh else None

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
        labels of others are kept, but ours that `body` lacks (run tag, model version, the
        visibility labels) are dropped."""
        obj["spec"] = copy.deepcopy(body["spec"])
        meta, want = obj.setdefault("metadata", {}), body["metadata"]
        annotations = {**(meta.get("annotations") or {}), **(want.get("annotations") or {})}
        for key in (RUN_TAG_ANNOTATION, MODEL_VERSION_ANNOTATION):
            if key not in (want.get("annotations") or {}):
                annotations.pop(key, None)
        meta["annotations"] = annotations
        labels = {**(meta.get("labels") or {}), **(want.get("labels") or {})}
        for key in (KNATIVE_VISIBILITY_LABEL, KSERVE_VISIBILITY_LABEL):
            if key not in (want.get("labels") or {}):
                labels.pop(key, None)  # serving_cluster_local turned off: public again
        meta["labels"] = labels

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
            entry = canary_entry(obj)
            if run_tag not in (deployed_by(obj), entry_annotation(entry, RUN_TAG_ANNOTATION)):
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
        version = served_version(obj)
        if recorded_mode(obj) == STANDARD:
            entry = canary_entry(obj)
            serving = predictor_service(name) if standard_serves(obj) else ""
            canary = entry is not None and entry_annotation(entry, RUN_TAG_ANNOTATION) == run_tag
            if canary:
                version = entry_annotation(entry, MODEL_VERSION_ANNOTATION)
        else:
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
