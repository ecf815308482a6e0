"""The simulated cluster's KServe: serving.kserve.io/v1beta1 InferenceService in Knative and
Standard mode.

A FAKE, for tests only. It does what KServe's controller and the Knative Serving it drives do
for one predictor, each rule following a file of kserve/kserve (at the commit the vendored
CRDs pin, tests/fixtures/crds/README.md) or knative/serving:

- deployment mode (pkg/controller/v1beta1/inferenceservice/utils/utils.go GetDeploymentMode):
  status.deploymentMode, else the `serving.kserve.io/deploymentMode` annotation (legacy names
  normalized), else the configured default, `Serverless` in KServe's shipped
  config/configmap/inferenceservice.yaml (`sim.config_maps[KSERVE_CONFIG]` sets another).
  Knative and Standard are simulated; ModelMesh is a sim error (`sim.errors`). The defaulter
  normalizes legacy annotations and writes a Standard default (inference_service_defaults.go,
  on create); the validating webhook refuses a mode change against status.deploymentMode,
  a predictor.name change without a storage URI change and invalid spec.canary entries
  (inference_service_validation.go; `KServe._validate`).
- Standard mode (components/predictor.go, reconcilers/deployment): a Deployment per
  predictor (`<isvc>[-<predictor name>]-predictor`) and one per spec.canary entry (its
  predictor merged over the stable one); a pod template change rolls (the old pod serves
  until the new one is ready: maxSurge/maxUnavailable 25% of one replica); pods carry the
  template's labels and annotations (buildObjectMeta) and `app: isvc.<deployment>`,
  restartPolicy Always and a TCP readiness probe (the kubelet's Ready condition). Status:
  PropagateRawStatus (PredictorReady from the Deployment's Available/Progressing,
  components.predictor.url; no revisions or traffic), status.canaryStatuses and
  CanaryPredictorReady, PropagateModelStatus over the stable pods; Deployments no longer
  named are deleted with their pods. Simplified: Deployments and Services are the sim's
  state, not API objects; one pod each; no ingress traffic split (a Service's address is
  `KServe.service_url`, the serving pod's 127.0.0.1 port); no progress deadline.
- Knative's validation of the Knative Service KServe builds (knative/serving
  pkg/apis/serving/fieldmask.go at knative-v1.21.1, default feature flags): a pod spec field
  or container securityContext field the masks drop is refused; KServe reports it as
  PredictorReady False ReconcileFailed with the webhook's denial (components/predictor.go),
  and makes no revision (`knative_disallowed`, `knative_denial`).
- runtimes (pkg/apis/serving/v1beta1/predictor_model.go GetSupportingRuntimes,
  RuntimeSupportsModel; components/predictor.go reconcileModel): a predictor with `model`
  is served by the named `runtime`, else by the first ServingRuntime in its namespace, then
  ClusterServingRuntime, that is enabled, single-model, not multi-node, supports the model
  format label (`mt:<name>[:<version>]`, formats with autoSelect only) and the protocol,
  ordered by priority. None: modelStatus InvalidSpec with lastFailureInfo reason
  NoSupportingRuntime ("No runtime found to support specified framework/version"; named
  runtimes: RuntimeNotRecognized, RuntimeDisabled, NoSupportingRuntime), the conditions
  left as initialized (Unknown; controller.go InitializeConditions). The sim installs one
  ClusterServingRuntime, `kserve-huggingfaceserver`, modelled on
  config/runtimes/kserve-huggingfaceserver.yaml (its image as the runtimes' kustomization
  names it) and validated against the vendored ServingRuntime CRD; `add_runtime` adds more.
  The runtime's container is merged with the model's (utils.go MergeRuntimeContainers: args
  appended to the runtime's, other fields the model's where set) and `{{.Name}}`-style
  placeholders are filled (utils.go ReplacePlaceholders).
- revisions (knative configuration): a new revision `<name>-predictor-<n, 5 digits>` only
  when the revision template changes: the predictor without canaryTrafficPercent (which goes
  to the route only, ksvc_reconciler.go), the InferenceService's labels and annotations
  minus KServe's disallowed list (constants.go ServiceAnnotationDisallowedList;
  components/predictor.go propagates the rest), and the runtime. Each revision runs a
  predictor pod (labels serving.knative.dev/revision, serving.kserve.io/inferenceservice,
  component: predictor; owned by the InferenceService) that the sim's kubelet runs.
  Configuration condition (knative configuration_lifecycle.go): Unknown while the latest
  created revision is not ready, True once it is, False `RevisionFailed` (`Revision "<rev>"
  failed with message: Container failed with: <log tail>.`) when its container exits.
  latestReadyRevision moves to the latest created revision when it becomes ready.
- traffic (ksvc_reconciler.go createKnativeService): with canaryTrafficPercent p and a
  latestRolledoutRevision R: target `latest` (latestRevision, p%, tag `latest` with tag
  routing) and, when p < 100, target `prev` (R, 100-p%, tag `prev`); otherwise `latest`
  100%. The route resolves `latest` to the latest ready revision (Knative), so a canary
  that is not ready takes no traffic; tagged targets get a `url` (the revision's own
  process). Route condition: True once every target resolves, else RevisionMissing
  (Unknown, `Configuration "<name>-predictor" is waiting for a Revision to become ready.`;
  False `... does not have any ready Revision.` once the revision failed). A percent outside
  0..100 is refused by Knative's route validation: PredictorReady False `ReconcileFailed`
  (components/predictor.go), nothing else changes.
- status (pkg/apis/serving/v1beta1/inference_service_status.go PropagateStatus, ported line
  by line): components.predictor {latestCreatedRevision, latestReadyRevision,
  latestRolledoutRevision (the ready revision once it has 100% through `latest`),
  previousRolledoutRevision, traffic, url and address (when the Knative Service is Ready)};
  conditions PredictorReady / PredictorRouteReady / PredictorConfigurationReady from the
  Knative Service, RoutesReady and LatestDeploymentReady across components,
  IngressReady, Stopped False, Ready (PredictorReady and IngressReady); observedGeneration
  is the Knative Service's generation (bumped by each change of template or traffic), as
  PropagateStatus copies it. modelStatus follows PropagateModelStatus for the pods of the
  latest created revision: Pending (InProgress) while it starts, Loaded (UpToDate) when
  Ready and latest created == latest ready, FailedToLoad (BlockedByFailedLoad, with
  lastFailureInfo {reason ModelLoadFailed, message, exitCode}) when its container exited
  with an error; activeModelState stays Loaded while an older revision serves.
- scale (Knative): pods of revisions the route no longer references (and that are not the
  latest created) are deleted; the one a rollback keeps at 0% behind its tag keeps running.
- delete: the garbage collector deletes the predictor pods; the kubelet stops them.

Sim differences, because pods are local processes:

- the Hugging Face runtime image cannot run here: its pod runs a stand-in,
  `python -m kubellm.serve <model dir> --name <--model_name> --host 127.0.0.1 --port <free>`
  (kubellm's server answers the runtime's routes); the runtime container it stands in for
  (image, merged args) is kept as the pod's annotation `sim.kubellm/runtime-container`. The
  runtime's argument handling is checked as its __main__.py would: `--backend` must name a
  Backend (auto, huggingface, vllm: argparse exits 2), and `vllm` fails as the CPU image
  has no vLLM ("Backend is set to 'vllm' but vLLM is not available", exit 1).
- storage: only `pvc://<claim>/<path>` (storageUri, or a custom container's STORAGE_URI) is
  emulated: the claim is mounted (at `sim.pvc_dir(claim)`, the kubelet's rule) and
  /mnt/models becomes `sim.pvc_dir(claim)/<path>`; other schemes fail the revision at once
  with ModelLoadFailed. A custom container needs `--port` (its value becomes a free port,
  `--host` becomes 127.0.0.1).
- routing: there is no traffic splitter. Each revision has its own URL
  (`http://127.0.0.1:<port>`); the service's url and address are the URL of the revision
  with the larger share (the rolled-out one on a tie).
- one pod per revision whatever min/maxReplicas say; restartPolicy Never, so a crash is a
  failed revision at once (a Deployment would CrashLoopBackOff); a ready revision's pod
  that is deleted is started again (new port), one that exits is not.
- readiness: `GET /v1/models/<served name>` answering 200 (KServe's V1 model-ready route;
  Knative probes the port), polled every 0.1 s.
- not simulated: transformers, explainers, multi-node, storage initializer containers,
  scale to zero, HPA.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import random
import re
import string
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from .fake_k8s import ApiError, Event, owner_reference, status_body
from .k8s_schemas import servingruntime_errors
from .sim_base import Controller, Key, find_condition, free_port, is_true, now_rfc3339

ISVC_LABEL = "serving.kserve.io/inferenceservice"
REVISION_LABEL = "serving.knative.dev/revision"
MODEL_DIR = "/mnt/models"
CONTAINER = "kserve-container"
TAG_ROUTING = "serving.kserve.io/enable-tag-routing"
DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
DEFAULT_DEPLOYMENT_MODE = "Serverless"  # config/configmap/inferenceservice.yaml
RUNTIME_CONTAINER_ANNOTATION = "sim.kubellm/runtime-container"
STORAGE_URI_ANNOTATION = "internal.serving.kserve.io/storage-initializer-sourceuri"
COMPONENT_LABEL = "component"  # constants.go KServiceComponentLabel
CANARY_READY = "CanaryPredictorReady"
KSERVE_CONFIG = ("kserve", "inferenceservice-config")  # (namespace, name) in sim.config_maps
ISVC_VALIDATOR = "inferenceservice.kserve-webhook-server.validator"
# constants.go ServiceAnnotationDisallowedList: not propagated to the revision template.
DISALLOWED_ANNOTATIONS = (
    "autoscaling.knative.dev/min-scale",
    "autoscaling.knative.dev/max-scale",
    "internal.serving.kserve.io/storage-initializer-sourceuri",
    "kubectl.kubernetes.io/last-applied-configuration",
    "modelFormat",  # constants.go ModelFormatAnnotationKey
)
# constants.go GetProtocolVersionInt: the order runtimes are sorted by.
PROTOCOL_ORDER = {"v1": 1, "v2": 2, "grpc-v1": 3, "grpc-v2": 4}
PROTOCOL_UNKNOWN = 5  # constants.go ProtocolVersion Unknown
# python/huggingfaceserver/huggingfaceserver/__init__.py Backend.
HF_BACKENDS = ("auto", "huggingface", "vllm")
# The ModelSpec fields that are not container fields (predictor_model.go ModelSpec,
# predictor.go PredictorExtensionSpec).
MODEL_ONLY = {
    "modelFormat",
    "runtime",
    "protocolVersion",
    "storageUri",
    "storage",
    "runtimeVersion",
}
POD_FIELDS = (
    "serviceAccountName",
    "securityContext",
    "nodeSelector",
    "tolerations",
    "affinity",
    "imagePullSecrets",
    "terminationGracePeriodSeconds",
    "automountServiceAccountToken",
    "hostIPC",
)

# knative/serving pkg/apis/serving/fieldmask.go at knative-v1.21.1 (KServe 0.20's go.mod:
# knative.dev/serving v0.48.1), under the default feature flags (pkg/apis/config/features.go
# defaultFeaturesConfig: every kubernetes.podspec-* flag Disabled but emptyDir).
# PodSpecMask: the pod fields a Knative Service admits; PodSecurityContextMask admits none
# while kubernetes.podspec-securitycontext is Disabled (fsGroupChangePolicy never).
KNATIVE_POD_FIELDS = (
    "serviceAccountName",
    "containers",
    "volumes",
    "imagePullSecrets",
    "enableServiceLinks",
)
# Every PodSpec field (k8s.io/api core/v1 PodSpec), to tell the pod's from KServe's own.
PODSPEC_FIELDS = (
    *KNATIVE_POD_FIELDS,
    "automountServiceAccountToken",
    "activeDeadlineSeconds",
    "affinity",
    "dnsConfig",
    "dnsPolicy",
    "ephemeralContainers",
    "hostAliases",
    "hostIPC",
    "hostNetwork",
    "hostPID",
    "hostUsers",
    "hostname",
    "initContainers",
    "nodeName",
    "nodeSelector",
    "os",
    "overhead",
    "preemptionPolicy",
    "priority",
    "priorityClassName",
    "readinessGates",
    "resourceClaims",
    "restartPolicy",
    "runtimeClassName",
    "schedulerName",
    "schedulingGates",
    "securityContext",
    "serviceAccount",
    "setHostnameAsFQDN",
    "shareProcessNamespace",
    "subdomain",
    "terminationGracePeriodSeconds",
    "tolerations",
    "topologySpreadConstraints",
)
# ContainerMask and SecurityContextMask (privileged only as false; CapabilitiesMask: drop,
# no add while kubernetes.containerspec-addcapabilities is Disabled).
KNATIVE_CONTAINER_FIELDS = (
    "name",
    "args",
    "command",
    "env",
    "workingDir",
    "envFrom",
    "image",
    "imagePullPolicy",
    "livenessProbe",
    "ports",
    "readinessProbe",
    "resources",
    "securityContext",
    "startupProbe",
    "terminationMessagePath",
    "terminationMessagePolicy",
    "volumeMounts",
)
KNATIVE_CONTAINER_SECURITY = (
    "capabilities",
    "readOnlyRootFilesystem",
    "runAsUser",
    "runAsGroup",
    "runAsNonRoot",
    "allowPrivilegeEscalation",
    "seccompProfile",
)
KNATIVE_WEBHOOK = "validation.webhook.serving.knative.dev"


def _set(value: Any) -> bool:
    """apis.CheckDisallowedFields flags a field whose value is not the zero value."""
    return value not in (None, False, 0, "", [], {})


def knative_disallowed(pod: dict[str, Any]) -> list[str]:
    """The fields Knative's validation refuses in a Knative Service's pod spec
    (k8s_validation.go ValidatePodSpec: CheckDisallowedFields against PodSpecMask,
    ValidatePodSecurityContext, and per container ContainerMask, SecurityContextMask,
    CapabilitiesMask), as `spec.template.spec.<path>`, under the default feature flags."""
    out = []
    for key in PODSPEC_FIELDS:
        value = pod.get(key)
        if key in KNATIVE_POD_FIELDS or not _set(value):
            continue
        if key == "automountServiceAccountToken":
            continue  # only false is admitted, and false is not set
        out.append(key)
    for key, value in (pod.get("securityContext") or {}).items():
        if _set(value):  # PodSecurityContextMask: nothing with podspec-securitycontext off
            out.append(f"securityContext.{key}")
    for i, container in enumerate(pod.get("containers") or []):
        where = f"containers[{i}]"
        out += [
            f"{where}.{k}"
            for k, v in container.items()
            if k not in KNATIVE_CONTAINER_FIELDS and _set(v)
        ]
        security = container.get("securityContext") or {}
        for key, value in security.items():
            allowed = key in KNATIVE_CONTAINER_SECURITY or (key == "privileged" and value is False)
            if not allowed and _set(value):
                out.append(f"{where}.securityContext.{key}")
        if _set((security.get("capabilities") or {}).get("add")):
            out.append(f"{where}.securityContext.capabilities.add")
    return [f"spec.template.spec.{path}" for path in out]


def knative_denial(fields: list[str], update: bool) -> str:
    """The PredictorReady message of a Knative Service Knative refused: predictor.go wraps
    reconcileKnativeDeployment's error ("fails to reconcile predictor"), which wraps the
    ksvc reconciler's ("fails to reconcile knative service", on an update only: a create's
    error is returned as is, ksvc_reconciler.go Reconcile); knative.dev/pkg FieldError
    ("must not set the field(s): ...") behind the API server's admission error."""
    message = (
        f'admission webhook "{KNATIVE_WEBHOOK}" denied the request: validation failed: '
        f"must not set the field(s): {', '.join(fields)}"
    )
    if update:
        message = f"fails to reconcile knative service: {message}"
    return f"fails to reconcile predictor: {message}"


# config/runtimes/kserve-huggingfaceserver.yaml at the pinned commit; the image is the one
# config/runtimes/kustomization.yaml substitutes for `huggingfaceserver:replace`.
HF_RUNTIME_YAML = """
apiVersion: serving.kserve.io/v1alpha1
kind: ClusterServingRuntime
metadata:
  name: kserve-huggingfaceserver
  annotations:
    serving.kserve.io/server-type: huggingfaceserver
spec:
  annotations:
    prometheus.kserve.io/port: '8080'
    prometheus.kserve.io/path: "/metrics"
  supportedModelFormats:
    - name: huggingface
      version: "1"
      autoSelect: true
      priority: 1
  protocolVersions:
    - v2
    - v1
  containers:
    - name: kserve-container
      image: kserve/huggingfaceserver:latest
      args:
        - --model_name={{.Name}}
      env:
        - name: LMCACHE_USE_EXPERIMENTAL
          value: "True"
      securityContext:
        allowPrivilegeEscalation: false
        privileged: false
        runAsNonRoot: true
        capabilities:
          drop:
            - ALL
      resources:
        requests:
          cpu: "1"
          memory: 2Gi
        limits:
          cpu: "1"
          memory: 2Gi
      volumeMounts:
        - name: devshm
          mountPath: /dev/shm
  volumes:
    - name: devshm
      emptyDir:
        medium: Memory
  hostIPC: false
"""


@dataclass
class _Revision:
    name: str  # <isvc>-predictor-00001
    template: str  # the revision template (canonical JSON)
    served: str  # the model name the server answers for
    predictor: dict[str, Any] = field(default_factory=dict)  # the spec it was made from
    runtime: dict[str, Any] | None = None
    pod: str = ""
    port: int = 0
    ready: bool = False  # became ready (Knative: stays so while scaled)
    failed: bool = False
    scaled_down: bool = False
    log_tail: str = ""
    exit_code: int | None = None


@dataclass
class _State:
    """What KServe and Knative keep outside the InferenceService (the Knative objects)."""

    uid: str
    revisions: list[_Revision] = field(default_factory=list)
    latest_ready: str = ""
    ksvc_generation: int = 0
    ksvc_spec: str = ""
    route: list[dict[str, Any]] = field(default_factory=list)  # resolved traffic
    deployments: dict[str, _Deployment] = field(default_factory=dict)  # Standard mode


@dataclass
class _Deployment:
    """An apps/v1 Deployment of Standard mode: its pods by ReplicaSet, oldest first (each
    a `_Revision` record: the pod template, its pod and port)."""

    name: str  # constants.go PredictorServiceName: <isvc>[-<predictor name>]-predictor
    generation: int = 0
    pods: list[_Revision] = field(default_factory=list)


def _cond(ctype: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    out = {"type": ctype, "status": status, "lastTransitionTime": now_rfc3339()}
    if reason:
        out["reason"] = reason
    if message:
        out["message"] = message
    return out


def replace_flag(argv: list[str], flag: str, value: str) -> tuple[list[str], bool]:
    """argv with the value of `flag` (`--flag v` or `--flag=v`) replaced; and whether found."""
    out, found, skip = [], False, False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == flag and i + 1 < len(argv):
            out += [arg, value]
            found, skip = True, True
        elif arg.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(arg)
    return out, found


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value of `flag` (argparse keeps the last), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def parse_deployment_mode(mode: str) -> str:
    """constants.go ParseDeploymentMode: legacy names normalized."""
    return {"RawDeployment": "Standard", "Serverless": "Knative", "": "Standard"}.get(mode, mode)


def ksvc_traffic(percent: int | None, rolled_out: str, tag_routing: bool) -> list[dict[str, Any]]:
    """ksvc_reconciler.go createKnativeService: the Knative Service's traffic targets."""
    latest_tag = {"tag": "latest"} if tag_routing else {}
    if percent is not None and rolled_out:
        targets = [{**latest_tag, "latestRevision": True, "percent": percent}]
        if percent < 100:
            targets.append(
                {
                    "revisionName": rolled_out,
                    "latestRevision": False,
                    "percent": 100 - percent,
                    "tag": "prev",
                }
            )
        return targets
    return [{**latest_tag, "latestRevision": True, "percent": 100}]


def propagate_status(spec: dict[str, Any], ksvc: dict[str, Any]) -> dict[str, Any]:
    """inference_service_status.go PropagateStatus, for the component status fields."""
    out = dict(spec)
    latest_ready = ksvc.get("latestReadyRevisionName", "")
    latest_created = ksvc.get("latestCreatedRevisionName", "")
    out["latestCreatedRevision"] = latest_created
    revision_traffic: dict[str, int] = {}
    for t in ksvc["traffic"]:
        if t.get("percent") is not None:
            rev = t.get("revisionName", "")
            revision_traffic[rev] = revision_traffic.get(rev, 0) + int(t["percent"])
    for t in ksvc["traffic"]:
        if t.get("revisionName") == latest_ready and t.get("latestRevision"):
            if out.get("latestRolledoutRevision", "") != latest_ready:
                if t.get("percent") == 100:
                    # track the last revision that's fully rolled out
                    out["previousRolledoutRevision"] = out.get("latestRolledoutRevision", "")
                    out["latestRolledoutRevision"] = latest_ready
            elif (
                # rolled out with 100% and then rolled back: back to the previous one
                latest_ready == latest_created
                and t.get("percent") is not None
                and t["percent"] < 100
                and revision_traffic.get(t.get("revisionName", "")) == 100
                and out.get("previousRolledoutRevision")
            ):
                out["latestRolledoutRevision"] = out["previousRolledoutRevision"]
    if latest_ready != out.get("latestReadyRevision"):
        out["latestReadyRevision"] = latest_ready
    if ksvc["ready"]:
        out["url"] = ksvc["url"]
        out["address"] = {"url": ksvc["url"]}
    out["traffic"] = ksvc["traffic"]
    return {k: v for k, v in out.items() if v not in ("", None)}


def _merge_named(base: list[dict[str, Any]], over: list[dict[str, Any]], key: str) -> list[Any]:
    """A strategic merge of two lists keyed by `key` (the later one wins per key)."""
    out = {item.get(key): copy.deepcopy(item) for item in base}
    for item in over:
        out[item.get(key)] = copy.deepcopy(item)
    return list(out.values())


def merge_runtime_container(runtime: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """utils.go MergeRuntimeContainers: the model's container fields patched over the
    runtime's (a strategic merge: env by name, volumeMounts by mountPath, resource maps
    per key), args appended to the runtime's."""
    merged = copy.deepcopy(runtime)
    for key, value in model.items():
        if key in MODEL_ONLY:
            continue
        if key == "args":
            merged["args"] = [*(runtime.get("args") or []), *value]
        elif key == "env":
            merged["env"] = _merge_named(runtime.get("env") or [], value, "name")
        elif key == "volumeMounts":
            merged["volumeMounts"] = _merge_named(
                runtime.get("volumeMounts") or [], value, "mountPath"
            )
        elif key in ("resources", "securityContext") and isinstance(value, dict):
            out = copy.deepcopy(runtime.get(key) or {})
            for sub, v in value.items():
                if isinstance(v, dict) and isinstance(out.get(sub), dict):
                    out[sub] = {**out[sub], **v}
                else:
                    out[sub] = copy.deepcopy(v)
            merged[key] = out
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def replace_placeholders(container: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """utils.go ReplacePlaceholders: the container as a Go template over the ObjectMeta
    (`{{.Name}}`, `{{.Namespace}}`, `{{.Labels.x}}`, `{{.Annotations.x}}`)."""

    def value(m: re.Match[str]) -> str:
        path = m[1].split(".")
        if path == ["Name"]:
            return str(meta.get("name", ""))
        if path == ["Namespace"]:
            return str(meta.get("namespace", ""))
        if len(path) == 2 and path[0] in ("Labels", "Annotations"):
            return str((meta.get(path[0].lower()) or {}).get(path[1], ""))
        raise ValueError(f"unsupported placeholder {m[0]}")

    text = json.dumps(container)
    return dict(json.loads(re.sub(r"\{\{\s*\.([A-Za-z.\-_/]+)\s*\}\}", value, text)))


def runtime_container_error(spec: dict[str, Any]) -> str | None:
    """Why a selected runtime's containers cannot serve (the modelStatus InvalidSpec message,
    reason InvalidPredictorSpec): none at all (predictor.go buildPodSpec ErrNoContainerFound),
    or none named kserve-container (utils.go MergeServingRuntimeAndInferenceServiceSpecs)."""
    containers = spec.get("containers") or []
    if not containers:
        return "no container configuration found in selected serving runtime"
    if not any(c.get("name") == CONTAINER for c in containers):
        return f"failed to find {CONTAINER} in ServingRuntime containers"
    return None


def protocol_version_priority(spec: dict[str, Any]) -> int:
    """predictor_model.go GetProtocolVersionPriority: the lowest of the runtime's protocol
    versions (v1 1, v2 2, grpc-v1 3, grpc-v2 4, any other 5), 5 (Unknown) when none."""
    ranks = [PROTOCOL_ORDER.get(p, PROTOCOL_UNKNOWN) for p in spec.get("protocolVersions") or []]
    return min(ranks) if ranks else PROTOCOL_UNKNOWN


def runtime_priority(spec: dict[str, Any], fmt: str | None) -> int | None:
    """servingruntime_types.go GetPriority: the priority of the first supported format of
    that name (None when it has none, or no format has the name)."""
    for f in spec.get("supportedModelFormats") or []:
        if f.get("name") == fmt:
            priority = f.get("priority")
            return int(priority) if priority is not None else None
    return None


def sort_supported_runtimes(
    runtimes: list[dict[str, Any]], fmt: str | None
) -> list[dict[str, Any]]:
    """The order GetSupportingRuntimes gives one scope's runtimes: sortServingRuntimeList
    (protocol version priority ascending, then newer creationTimestamp first, then name),
    then sortSupportedRuntimeByPriority (stable: a runtime with a priority for the format
    before one without, higher first; ties keep the first order)."""
    out = sorted(runtimes, key=lambda r: r["metadata"]["name"])
    out.sort(key=lambda r: r["metadata"]["creationTimestamp"], reverse=True)
    out.sort(key=lambda r: protocol_version_priority(r["spec"]))

    def by_priority(r: dict[str, Any]) -> tuple[bool, int]:
        priority = runtime_priority(r["spec"], fmt)
        return (priority is None, -(priority or 0))

    out.sort(key=by_priority)
    return out


def predictor_service(isvc: str, predictor_name: str = "") -> str:
    """constants.go PredictorServiceName: a predictor's Deployment and Service."""
    return f"{isvc}-{predictor_name}-predictor" if predictor_name else f"{isvc}-predictor"


def get_deployment_mode(status_mode: str, annotations: dict[str, Any], default: str) -> str:
    """utils.go GetDeploymentMode: the status's (parsed), else a valid annotation (legacy
    names normalized), else the configured default as it is written."""
    if status_mode:
        return parse_deployment_mode(status_mode)
    legacy = {"RawDeployment": "Standard", "Serverless": "Knative"}
    mode = str(annotations.get(DEPLOYMENT_MODE, ""))
    mode = legacy.get(mode, mode)
    if DEPLOYMENT_MODE in annotations and mode in ("Standard", "Knative", "ModelMesh"):
        return mode
    return default


def mergo_override(dst: Any, src: Any) -> Any:
    """mergo.Merge(&dst, src, mergo.WithOverride) on JSON: maps and structs merged key by
    key, a set (non-empty) value of src overriding; slices replaced."""
    if isinstance(dst, dict) and isinstance(src, dict):
        out = copy.deepcopy(dst)
        for k, v in src.items():
            if v in (None, "", [], {}):
                continue
            out[k] = mergo_override(out.get(k), v) if isinstance(v, dict) else copy.deepcopy(v)
        return out
    return copy.deepcopy(src)


def canary_spec_errors(isvc: dict[str, Any]) -> list[str]:
    """inference_service_validation.go validateCanarySpecs, for what kubellm can send."""
    spec = isvc.get("spec") or {}
    canaries = spec.get("canary") or []
    if not canaries:
        return []
    annotations = (isvc.get("metadata") or {}).get("annotations") or {}
    if annotations.get(DEPLOYMENT_MODE) != "Standard":
        return ["canary is only supported in Standard deployment mode"]
    stable = spec.get("predictor") or {}
    names: set[str] = set()
    total = 0
    for i, entry in enumerate(canaries):
        cp = entry.get("predictor") or {}
        name = cp.get("name") or ""
        percent = int(entry.get("trafficPercent") or 0)
        if not name:
            return [f"canary[{i}] predictor.name is required"]
        if name in names:
            return [f"canary predictor.name {name!r} is duplicated"]
        names.add(name)
        if name == (stable.get("name") or ""):
            return [f"canary predictor.name {name!r} conflicts with stable predictor name"]
        if not 0 <= percent <= 100:
            return [f"canary {name!r} trafficPercent must be between 0 and 100, got {percent}"]
        total += percent
        if cp.get("maxReplicas"):
            return [f"canary {name!r} must not set maxReplicas (canary uses fixed replicas)"]
        low = cp.get("minReplicas")
        if low is not None and low > stable.get("minReplicas", 1):
            return [
                f"canary {name!r} minReplicas ({low}) must not exceed stable predictor "
                f"minReplicas ({stable.get('minReplicas', 1)})"
            ]
    if total > 100:
        return [f"sum of canary trafficPercent values ({total}) must be <= 100"]
    return []


def storage_uri(predictor: dict[str, Any]) -> str:
    """inference_service_validation.go getPredictorStorageURI (model or custom container)."""
    model = predictor.get("model") or {}
    if model.get("storageUri"):
        return str(model["storageUri"])
    for c in (predictor.get("containers") or [])[:1]:
        for e in c.get("env") or []:
            if e.get("name") == "STORAGE_URI":
                return str(e.get("value") or "")
    return ""


def model_transition(model: dict[str, Any], state: str, info: dict[str, Any] | None) -> None:
    """inference_service_status.go UpdateModelTransitionStatus: the target state, the
    transition it implies, the active state once Loaded, the last failure's info."""
    states = model.setdefault("states", {"activeModelState": ""})
    states["targetModelState"] = state
    if state in ("Pending", "Loading"):
        model["transitionStatus"] = "InProgress"
    elif state == "Loaded":
        model["transitionStatus"] = "UpToDate"
        states["activeModelState"] = "Loaded"
    elif state == "FailedToLoad":
        model["transitionStatus"] = "BlockedByFailedLoad"
    if info is not None:
        model["lastFailureInfo"] = info


class KServe(Controller):
    name = "kserve"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._states: dict[Key, _State] = {}
        self.runtimes: dict[tuple[str, str, str], dict[str, Any]] = {}  # kind, ns, name
        self.add_runtime(yaml.safe_load(HF_RUNTIME_YAML))
        sim.fake.on_admit("inferenceservices", self._default)
        sim.fake.on_validate("inferenceservices", self._validate)

    # ------------------------------------------------------------ webhooks

    def default_mode(self) -> str:
        """deploy.defaultDeploymentMode of kserve/inferenceservice-config (a test sets
        sim.config_maps[KSERVE_CONFIG]); Serverless as KServe ships it."""
        data = self.sim.config_maps.get(KSERVE_CONFIG) or {}
        deploy = json.loads(data.get("deploy") or "{}")
        return str(deploy.get("defaultDeploymentMode") or DEFAULT_DEPLOYMENT_MODE)

    def _default(self, _fake: Any, body: dict[str, Any], _ns: str) -> dict[str, Any]:
        """inference_service_defaults.go DefaultInferenceService: legacy mode annotations
        normalized; none: the default written when it is ModelMesh or Standard."""
        meta = body.setdefault("metadata", {})
        annotations = meta.get("annotations") or {}
        mode = annotations.get(DEPLOYMENT_MODE)
        if mode is not None:
            legacy = {"RawDeployment": "Standard", "Serverless": "Knative"}
            annotations[DEPLOYMENT_MODE] = legacy.get(mode, mode)
        elif self.default_mode() in ("ModelMesh", "Standard"):
            annotations[DEPLOYMENT_MODE] = self.default_mode()
        if annotations:
            meta["annotations"] = annotations
        return body

    def _validate(
        self, _fake: Any, body: dict[str, Any], old: dict[str, Any] | None, _ns: str
    ) -> None:
        """inference_service_validation.go ValidateUpdate (validateDeploymentMode,
        validatePredictorNameChange) and validateCanarySpecs, as the webhook's denial."""
        errors = []
        if old is not None and not (body.get("metadata") or {}).get("deletionTimestamp"):
            was = str((old.get("status") or {}).get("deploymentMode") or "")
            annotations = (body.get("metadata") or {}).get("annotations") or {}
            now = annotations.get(DEPLOYMENT_MODE)
            # the defaulter runs on updates too (the fake's on_admit only on creates)
            now = {"RawDeployment": "Standard", "Serverless": "Knative"}.get(now, now)
            if was and now is not None and now != parse_deployment_mode(was):
                errors.append(
                    "update rejected: deploymentMode cannot be changed from "
                    f"'{parse_deployment_mode(was)}' to '{now}'"
                )
            new_p = (body.get("spec") or {}).get("predictor") or {}
            old_p = (old.get("spec") or {}).get("predictor") or {}
            renamed = new_p.get("name") != old_p.get("name")
            if not errors and renamed and storage_uri(new_p) == storage_uri(old_p):
                errors.append("predictor.name change requires a model change (e.g. storageUri)")
        errors = errors or canary_spec_errors(body)
        if errors:
            raise ApiError(
                400,
                status_body(
                    400, "", f'admission webhook "{ISVC_VALIDATOR}" denied the request: {errors[0]}'
                ),
            )

    def service_url(self, namespace: str, service: str) -> str:
        """Where Service `service` (a Standard mode predictor's) routes: the sim's stand-in
        for its cluster DNS name, the address of its serving pod (the oldest ready one; a
        rolling update keeps the old pod until the new is ready). "" when none serves."""
        for (_, ns, _), state in list(self._states.items()):
            dep = state.deployments.get(service) if ns == namespace else None
            if dep is not None:
                ready = [p for p in dep.pods if p.ready and not p.failed]
                return f"http://127.0.0.1:{ready[0].port}" if ready else ""
        return ""

    def add_runtime(self, obj: dict[str, Any], namespace: str = "") -> None:
        """Install a ServingRuntime (in `namespace`) or ClusterServingRuntime, validated
        against the vendored ServingRuntime CRD (a ClusterServingRuntime has its schema)."""
        errors = servingruntime_errors(self.sim.fake.crds, obj)
        if errors:
            raise ValueError(f"invalid {obj.get('kind')}: {'; '.join(errors)}")
        kind = obj["kind"]
        if kind not in ("ServingRuntime", "ClusterServingRuntime"):
            raise ValueError(f"not a serving runtime: {kind}")
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("creationTimestamp", now_rfc3339())
        ns = namespace if kind == "ServingRuntime" else ""
        self.runtimes[(kind, ns, obj["metadata"]["name"])] = obj

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.plural == "inferenceservices":
            return self.own_key(event, "inferenceservices")
        if event.plural == "pods":
            return self.owner_key(event, "InferenceService")
        return []

    # ------------------------------------------------------------ reconcile

    def reconcile(self, key: Key) -> None:
        isvc = self.get(key)
        if isvc is None:
            self._states.pop(key, None)  # its pods go with it (the garbage collector)
            return
        meta = isvc["metadata"]
        state = self._states.get(key)
        if state is None or state.uid != meta["uid"]:
            state = self._states[key] = _State(meta["uid"])
        status = copy.deepcopy(isvc.get("status") or {})
        if find_condition(status, "Ready") is None:  # controller.go InitializeConditions
            status["conditions"] = [
                _cond(t, "Unknown") for t in ("IngressReady", "PredictorReady", "Ready")
            ]
        annotations = meta.get("annotations") or {}
        mode = get_deployment_mode(
            str(status.get("deploymentMode") or ""), annotations, self.default_mode()
        )
        status["deploymentMode"] = mode  # controller.go: what GetDeploymentMode returned
        if parse_deployment_mode(mode) not in ("Knative", "Standard"):
            self.sim.errors.append(
                f"{self.name} {key}: deployment mode {mode}: the sim simulates Knative and "
                "Standard only"
            )
            return
        predictor = (isvc.get("spec") or {}).get("predictor") or {}
        runtime: dict[str, Any] | None = None
        if predictor.get("model"):
            found = self._resolve(predictor["model"], meta["namespace"])
            if isinstance(found, tuple):
                self._write(key, isvc, self._invalid_spec(status, *found))
                return
            runtime = found
            why = runtime_container_error(runtime["spec"])
            if (
                why
            ):  # predictor.go buildPodSpec / utils.go MergeServingRuntimeAndInferenceServiceSpecs
                self._write(key, isvc, self._invalid_spec(status, "InvalidPredictorSpec", why))
                return
            kind, name = runtime["kind"], runtime["metadata"]["name"]
            field_name = (
                "clusterServingRuntimeName"
                if kind == "ClusterServingRuntime"
                else "servingRuntimeName"
            )
            status[field_name] = name
        elif not predictor.get("containers"):
            self._write(
                key,
                isvc,
                self._invalid_spec(
                    status, "InvalidPredictorSpec", "the sim runs model and containers predictors"
                ),
            )
            return
        if parse_deployment_mode(mode) == "Standard":
            self._reconcile_standard(key, isvc, state, status, predictor, runtime)
            return
        denied = knative_disallowed(self._ksvc_pod(isvc, predictor, runtime))
        if denied:  # components/predictor.go: PropagateRawStatusWithMessages, nothing else
            message = knative_denial(denied, update=bool(state.revisions))
            self._set_conditions(status, {"PredictorReady": ("False", "ReconcileFailed", message)})
            self._write(key, isvc, status)
            return
        pred_status = dict((status.get("components") or {}).get("predictor") or {})
        percent = predictor.get("canaryTrafficPercent")
        rolled_out = pred_status.get("latestRolledoutRevision", "")
        if percent is not None and rolled_out and not 0 <= percent <= 100:
            # knative route validation (TrafficTarget percent), surfaced as predictor.go does
            message = (
                "fails to reconcile knative service: admission webhook denied the request: "
                f"expected 0 <= {percent} <= 100: spec.traffic[0].percent"
            )
            self._set_conditions(status, {"PredictorReady": ("False", "ReconcileFailed", message)})
            self._write(key, isvc, status)
            return
        traffic = ksvc_traffic(percent, rolled_out, annotations.get(TAG_ROUTING) == "true")
        template = self._template(isvc, predictor, runtime)
        if not state.revisions or state.revisions[-1].template != template:
            state.revisions.append(self._start(isvc, state, predictor, runtime, template))
        ksvc_spec = json.dumps([template, traffic], sort_keys=True)
        if ksvc_spec != state.ksvc_spec:
            state.ksvc_generation += 1
            state.ksvc_spec = ksvc_spec
        busy = self._observe(isvc, state)
        latest = state.revisions[-1]
        if latest.ready and not latest.failed:
            state.latest_ready = latest.name
        ksvc = self._knative_service(isvc, state, traffic)
        pred = propagate_status(pred_status, ksvc)
        status.setdefault("components", {})["predictor"] = pred
        status["observedGeneration"] = state.ksvc_generation
        self._conditions(status, ksvc)
        if ksvc["ready"]:
            status["url"] = ksvc["url"]
            status["address"] = {"url": ksvc["url"]}
        status["modelStatus"] = self._model_status(status, latest, ksvc)
        self._scale_down(isvc, state, ksvc)
        self._write(key, isvc, status)
        if busy:
            self.requeue(key, 0.1)

    # ------------------------------------------------------------ Standard mode

    def _reconcile_standard(
        self,
        key: Key,
        isvc: dict[str, Any],
        state: _State,
        status: dict[str, Any],
        predictor: dict[str, Any],
        runtime: dict[str, Any] | None,
    ) -> None:
        """components/predictor.go Reconcile in Standard mode: the canaries' Deployments
        first (reconcileCanaryDeployments: status.canaryStatuses, CanaryPredictorReady, the
        orphaned predictor Deployments deleted), then the stable one (reconcileRawDeployment)
        and PropagateRawStatus, PropagateModelStatus over the stable Deployment's pods."""
        name = isvc["metadata"]["name"]
        spec = isvc.get("spec") or {}
        stable = predictor_service(name, str(predictor.get("name") or ""))
        expected = {stable}
        busy = False
        canary_statuses = []
        for entry in spec.get("canary") or []:
            cp = entry.get("predictor") or {}
            cname = predictor_service(name, str(cp.get("name") or ""))
            expected.add(cname)
            merged = mergo_override(predictor, cp)  # buildCanaryPredictor
            for k in ("maxReplicas", "minReplicas", "scaleTarget", "scaleMetric", "autoScaling"):
                merged.pop(k, None)
            crt = runtime
            if merged.get("model") and merged["model"] != predictor.get("model"):
                found = self._resolve(merged["model"], isvc["metadata"]["namespace"])
                crt = found if isinstance(found, dict) else None
            busy = self._roll(isvc, state, cname, merged, crt) or busy
            dep = state.deployments[cname]
            canary_statuses.append(
                {
                    "name": cp.get("name") or "",
                    "ready": any(p.ready for p in dep.pods),  # AvailableReplicas > 0
                    "trafficPercent": int(entry.get("trafficPercent") or 0),
                }
            )
        if canary_statuses:
            status["canaryStatuses"] = canary_statuses
            ready = all(c["ready"] for c in canary_statuses)
            reason = "AllCanariesReady" if ready else "CanariesNotReady"
            self._set_conditions(status, {CANARY_READY: (str(ready), reason, "")})
        else:
            status.pop("canaryStatuses", None)
            status["conditions"] = [
                c for c in status.get("conditions") or [] if c["type"] != CANARY_READY
            ]
        for dname in list(state.deployments):  # the orphan cleanup
            if dname not in expected:
                for rec in state.deployments.pop(dname).pods:
                    self._delete_pod(isvc, rec)
        busy = self._roll(isvc, state, stable, predictor, runtime) or busy
        dep = state.deployments[stable]
        available = [p for p in dep.pods if p.ready]
        newest = dep.pods[-1]
        rs = newest.name
        if available:
            ready = ("True", "MinimumReplicasAvailable", "Deployment has minimum availability.")
        else:
            ready = (
                "False",
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.",
            )
        if newest.ready and len(dep.pods) == 1:  # Progressing True NewReplicaSetAvailable
            ready = (
                "True",
                "NewReplicaSetAvailable",
                f'ReplicaSet "{rs}" has successfully progressed.',
            )
        pred = dict((status.get("components") or {}).get("predictor") or {})
        url = f"http://127.0.0.1:{available[0].port}" if available else ""
        if ready[0] == "True":
            pred["url"] = url
        status.setdefault("components", {})["predictor"] = pred
        status["observedGeneration"] = dep.generation
        conds: dict[str, tuple[str, str, str]] = {"PredictorReady": ready}
        ingress = find_condition(status, "IngressReady") or {}
        if ready[0] == "True" or ingress.get("status") == "True":
            conds["IngressReady"] = ("True", "", "")
        self._set_conditions(status, conds)
        if ready[0] == "True":
            status["url"] = url
            status["address"] = {"url": url}
        status["modelStatus"] = self._raw_model_status(isvc, status, dep)
        self._write(key, isvc, status)
        if busy:
            self.requeue(key, 0.1)

    def _raw_template(
        self, isvc: dict[str, Any], predictor: dict[str, Any], runtime: dict[str, Any] | None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """The pod template's labels and annotations (predictor.go buildObjectMeta: the
        runtime's, the InferenceService's, the predictor's, later winning; annotations on
        the disallowed list left out; the storage initializer's source URI annotation)."""
        meta = isvc["metadata"]
        rspec = (runtime or {}).get("spec") or {}

        def allowed(a: dict[str, Any] | None) -> dict[str, str]:
            return {k: v for k, v in (a or {}).items() if k not in DISALLOWED_ANNOTATIONS}

        annotations = allowed(meta.get("annotations"))
        uri = ((predictor.get("model") or {}).get("storageUri")) or ""
        if uri:
            annotations[STORAGE_URI_ANNOTATION] = uri
        annotations = {
            **allowed(rspec.get("annotations")),
            **annotations,
            **allowed(predictor.get("annotations")),
        }
        labels = {
            **(rspec.get("labels") or {}),
            **(meta.get("labels") or {}),
            **(predictor.get("labels") or {}),
            ISVC_LABEL: meta["name"],
            COMPONENT_LABEL: "predictor",
        }
        return labels, annotations

    def _roll(
        self,
        isvc: dict[str, Any],
        state: _State,
        dname: str,
        predictor: dict[str, Any],
        runtime: dict[str, Any] | None,
    ) -> bool:
        """A Deployment's rolling update (deployment_reconciler.go setDefaultDeploymentSpec:
        maxSurge and maxUnavailable 25%, of one replica: one new pod, none unavailable): a
        changed pod template starts a pod of a new ReplicaSet; the old pods serve until it
        is ready, then go. Whether it is still on its way."""
        labels, annotations = self._raw_template(isvc, predictor, runtime)
        body = {"labels": labels, "annotations": annotations}
        body["spec"] = self._ksvc_pod(isvc, predictor, runtime)
        for k in ("minReplicas", "maxReplicas"):
            body["spec"].pop(k, None)
        template = json.dumps(body, sort_keys=True)
        dep = state.deployments.setdefault(dname, _Deployment(dname))
        if not dep.pods or dep.pods[-1].template != template:
            dep.generation += 1
            digest = hashlib.sha256(template.encode()).hexdigest()[:10]
            rec = _Revision(
                f"{dname}-{digest}",
                template,
                isvc["metadata"]["name"],
                copy.deepcopy(predictor),
                copy.deepcopy(runtime),
            )
            # an old ReplicaSet's pod that never became available is scaled down at once
            for old in [p for p in dep.pods if not p.ready]:
                self._delete_pod(isvc, old)
            dep.pods = [p for p in dep.pods if p.ready] + [rec]
            self._start_raw(isvc, rec, labels, annotations)
        busy = False
        for rec in dep.pods:
            busy = self._observe_raw(isvc, rec) or busy
        if dep.pods[-1].ready and len(dep.pods) > 1:
            for old in dep.pods[:-1]:
                self._delete_pod(isvc, old)
            dep.pods = dep.pods[-1:]
        return busy or not dep.pods[-1].ready

    def _start_raw(
        self,
        isvc: dict[str, Any],
        rec: _Revision,
        labels: dict[str, str],
        annotations: dict[str, str],
    ) -> None:
        """The Deployment's pod: its template's labels (with `app: isvc.<deployment>`,
        deployment_reconciler.go createRawDefaultDeployment) and annotations, restartPolicy
        Always and the default TCP readiness probe (setDefaultPodSpec) on the sim's port."""
        try:
            pod = self._pod(isvc, rec, rec.predictor, rec.runtime)
        except _CannotRun as e:
            rec.failed, rec.log_tail = True, str(e)
            return
        spec = pod["spec"]
        spec["restartPolicy"] = "Always"
        for c in spec["containers"]:
            c["readinessProbe"] = {"tcpSocket": {"port": rec.port}, "periodSeconds": 10}
        dname = rec.name.rsplit("-", 1)[0]
        pod_labels = {
            **labels,
            "app": f"isvc.{dname}",  # constants.go GetRawServiceLabel
            "pod-template-hash": rec.name.rsplit("-", 1)[1],
        }
        self._create_pod(
            isvc,
            rec,
            {"annotations": {**annotations, **pod["annotations"]}, "spec": spec},
            pod_labels,
        )

    def _observe_raw(self, isvc: dict[str, Any], rec: _Revision) -> bool:
        """A Deployment pod's readiness is its Ready condition (the kubelet's probe); one
        deleted under us is replaced by its ReplicaSet. Whether it is not ready yet."""
        if rec.failed or not rec.pod:
            return False
        pod = self.fake.get_object("pods", rec.pod, isvc["metadata"]["namespace"])
        if pod is None:
            rec.ready = False
            labels, annotations = self._raw_template(isvc, rec.predictor, rec.runtime)
            self._start_raw(isvc, rec, labels, annotations)
            return True
        rec.ready = bool(
            not pod["metadata"].get("deletionTimestamp")
            and is_true(pod.get("status") or {}, "Ready")
        )
        return not rec.ready

    def _delete_pod(self, isvc: dict[str, Any], rec: _Revision) -> None:
        rec.scaled_down = True
        if rec.pod:
            with contextlib.suppress(ApiError):
                self.fake.delete_object("pods", rec.pod, isvc["metadata"]["namespace"])

    def _raw_model_status(
        self, isvc: dict[str, Any], status: dict[str, Any], dep: _Deployment
    ) -> dict[str, Any]:
        """inference_service_status.go PropagateModelStatus with rawDeployment: the pods of
        the stable Deployment (label app); none: Pending; Ready: Loaded; else by the first
        pod's kserve-container: terminated Error or CrashLoopBackOff FailedToLoad
        (ModelLoadFailed, message, exit code), otherwise Pending."""
        model = copy.deepcopy(status.get("modelStatus") or {})
        ns = isvc["metadata"]["namespace"]
        pods = [
            self.fake.get_object("pods", r.pod, ns) for r in dep.pods if r.pod and not r.scaled_down
        ]
        live = [p for p in pods if p is not None]
        ready = sum(1 for p in live if is_true(p.get("status") or {}, "Ready"))
        model["copies"] = {**(model.get("copies") or {"failedCopies": 0}), "totalCopies": ready}

        def update(state: str, info: dict[str, Any] | None = None) -> None:
            model_transition(model, state, info)

        if not live:
            update("Pending")
        elif is_true(status, "Ready"):
            update("Loaded")
        else:
            update("Pending")
            for cs in (live[0].get("status") or {}).get("containerStatuses") or []:
                if cs.get("name") != CONTAINER:
                    continue
                st = cs.get("state") or {}
                terminated = st.get("terminated") or {}
                if (st.get("waiting") or {}).get("reason") == "CrashLoopBackOff":
                    terminated = (cs.get("lastState") or {}).get("terminated") or {}
                elif terminated.get("reason") != "Error":
                    terminated = {}
                if terminated:
                    log = self.fake.pod_log(ns, live[0]["metadata"]["name"])
                    message = terminated.get("message") or " ".join(log.strip().splitlines()[-3:])
                    update(
                        "FailedToLoad",
                        {
                            "reason": "ModelLoadFailed",
                            "message": message,
                            "exitCode": terminated.get("exitCode"),
                        },
                    )
        return model

    # ------------------------------------------------------------ runtimes

    def _resolve(self, model: dict[str, Any], ns: str) -> dict[str, Any] | tuple[str, str]:
        """The runtime serving `model`, or (failure reason, message) (reconcileModel)."""
        fmt = model.get("modelFormat") or {}
        label = f"mt:{fmt.get('name')}" + (f":{fmt['version']}" if fmt.get("version") else "")
        protocol = model.get("protocolVersion")
        named = model.get("runtime")
        if named:
            found = self.runtimes.get(("ServingRuntime", ns, named)) or self.runtimes.get(
                ("ClusterServingRuntime", "", named)
            )
            if found is None:
                return "RuntimeNotRecognized", "Waiting for runtime to become available"
            spec = found["spec"]
            if spec.get("disabled"):
                return "RuntimeDisabled", "Specified runtime is disabled"
            if protocol and not self._speaks(spec, protocol):
                return (
                    "NoSupportingRuntime",
                    "Specified runtime does not support specified protocol version",
                )
            if label not in self._labels(spec, explicit=True):
                return (
                    "NoSupportingRuntime",
                    "Specified runtime does not support specified framework/version",
                )
            return found
        for kind, where in (("ServingRuntime", ns), ("ClusterServingRuntime", "")):
            candidates = [
                r
                for (k, n, _), r in self.runtimes.items()
                if k == kind
                and n == where
                and not r["spec"].get("disabled")
                and not r["spec"].get("multiModel")
                and r["spec"].get("workerSpec") is None
                and label in self._labels(r["spec"], explicit=False)
                and self._speaks(r["spec"], protocol or "v1")
            ]
            candidates = sort_supported_runtimes(candidates, fmt.get("name"))
            if candidates:
                return candidates[0]
        return "NoSupportingRuntime", "No runtime found to support specified framework/version"

    @staticmethod
    def _labels(spec: dict[str, Any], explicit: bool) -> set[str]:
        """getServingRuntimeSupportedModelFormatLabelSet: autoSelect formats unless named."""
        out = set()
        for f in spec.get("supportedModelFormats") or []:
            if explicit or f.get("autoSelect"):
                out.add(f"mt:{f['name']}")
                if f.get("version"):
                    out.add(f"mt:{f['name']}:{f['version']}")
        return out

    @staticmethod
    def _speaks(spec: dict[str, Any], protocol: str) -> bool:
        """servingruntime_types.go IsProtocolVersionSupported."""
        versions = spec.get("protocolVersions") or []
        return not versions or protocol in versions

    # ------------------------------------------------------------ revisions

    @staticmethod
    def _template(
        isvc: dict[str, Any], predictor: dict[str, Any], runtime: dict[str, Any] | None
    ) -> str:
        """What makes a new Knative revision: everything but the route's canary share."""
        meta = isvc["metadata"]
        annotations = {
            k: v
            for k, v in (meta.get("annotations") or {}).items()
            if k not in DISALLOWED_ANNOTATIONS
        }
        body = {
            "predictor": {k: v for k, v in predictor.items() if k != "canaryTrafficPercent"},
            "annotations": annotations,
            "labels": meta.get("labels") or {},
            "runtime": (runtime or {}).get("spec"),
        }
        return json.dumps(body, sort_keys=True)

    def _start(
        self,
        isvc: dict[str, Any],
        state: _State,
        predictor: dict[str, Any],
        runtime: dict[str, Any] | None,
        template: str,
    ) -> _Revision:
        """A new revision and its pod (a failed revision at once when the sim cannot run it)."""
        meta = isvc["metadata"]
        name = meta["name"]
        revision = _Revision(
            f"{name}-predictor-{len(state.revisions) + 1:05d}",
            template,
            name,
            copy.deepcopy(predictor),
            copy.deepcopy(runtime),
        )
        try:
            pod = self._pod(isvc, revision, predictor, runtime)
        except _CannotRun as e:
            revision.failed, revision.log_tail = True, str(e)
            return revision
        self._create_pod(isvc, revision, pod)
        return revision

    @staticmethod
    def _ksvc_pod(
        isvc: dict[str, Any], predictor: dict[str, Any], runtime: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The pod spec KServe puts in the Knative Service (predictor.go buildPodSpec: the
        predictor's pod fields over the runtime's, the merged kserve-container)."""
        pod = {k: v for k, v in predictor.items() if k in PODSPEC_FIELDS}
        if runtime is not None:
            spec = runtime["spec"]
            for k in PODSPEC_FIELDS:
                if k in spec and k not in pod and k != "containers":
                    pod[k] = spec[k]
            base = next((c for c in spec.get("containers") or [] if c.get("name") == CONTAINER), {})
            pod["containers"] = [
                replace_placeholders(
                    merge_runtime_container(base, predictor["model"]), isvc["metadata"]
                )
            ]
        return pod

    def _pod(
        self,
        isvc: dict[str, Any],
        revision: _Revision,
        predictor: dict[str, Any],
        runtime: dict[str, Any] | None,
    ) -> dict[str, Any]:
        meta = isvc["metadata"]
        predictor = copy.deepcopy(predictor)
        volumes: list[dict[str, Any]] = list(predictor.get("volumes") or [])
        annotations = {"sim.kubellm/revision": revision.name}
        if runtime is not None:
            model = predictor["model"]
            runtime_spec = runtime["spec"]
            base = next(
                (c for c in runtime_spec.get("containers") or [] if c.get("name") == CONTAINER),
                None,
            )
            if base is None:  # refused before (runtime_container_error)
                raise _CannotRun(f"failed to find {CONTAINER} in ServingRuntime containers")
            real = replace_placeholders(merge_runtime_container(base, model), meta)
            annotations[RUNTIME_CONTAINER_ANNOTATION] = json.dumps(real, sort_keys=True)
            volumes = _merge_named(runtime_spec.get("volumes") or [], volumes, "name")
            for k in POD_FIELDS:
                if k in runtime_spec and k not in predictor:
                    predictor[k] = runtime_spec[k]
            uri = model.get("storageUri") or ""
            container, mount = self._stand_in(real, uri, revision)
        else:
            container = copy.deepcopy(predictor["containers"][0])
            env = {e.get("name"): e.get("value") for e in container.get("env") or []}
            uri = env.get("STORAGE_URI") or ""
            container, mount = self._custom(container, uri, revision)
        if mount is not None:
            volumes.append(mount[0])
            container.setdefault("volumeMounts", []).append(mount[1])
        # components/predictor.go: INFERENCE_SERVICE_NAME in every container
        container["env"] = [
            *(e for e in container.get("env") or [] if e.get("name") != "INFERENCE_SERVICE_NAME"),
            {"name": "INFERENCE_SERVICE_NAME", "value": meta["name"]},
        ]
        spec = {k: v for k, v in predictor.items() if k in POD_FIELDS}
        spec.update(containers=[container], restartPolicy="Never")
        if volumes:
            spec["volumes"] = volumes
        return {"annotations": annotations, "spec": spec}

    def _local_model_dir(
        self, uri: str
    ) -> tuple[str, tuple[dict[str, Any], dict[str, Any]] | None]:
        """Where /mnt/models is, and the claim's volume and mount (storage initializer).
        A claim that does not exist is the kubelet's to report (Unschedulable)."""
        if not uri:
            return MODEL_DIR, None
        if not uri.startswith("pvc://"):
            raise _CannotRun(f"the sim's storage initializer supports pvc:// only, not {uri}")
        claim, _, path = uri[len("pvc://") :].partition("/")
        root = self.sim.tmp_path / "pvc" / claim  # sim.pvc_dir(claim), without creating it
        volume = {
            "name": "kserve-pvc-source",
            "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
        }
        mount = {"name": "kserve-pvc-source", "mountPath": str(root), "readOnly": True}
        return str(root / path), (volume, mount)

    def _stand_in(
        self, real: dict[str, Any], uri: str, revision: _Revision
    ) -> tuple[dict[str, Any], tuple[dict[str, Any], dict[str, Any]] | None]:
        """The container that runs in place of the Hugging Face runtime image."""
        args = [str(a) for a in real.get("args") or []]
        served = flag_value(args, "--model_name") or "model"  # model_server.py default
        backend = flag_value(args, "--backend") or "auto"
        model_dir = flag_value(args, "--model_dir") or MODEL_DIR
        local, mount = self._local_model_dir(uri)
        if model_dir.startswith(MODEL_DIR):
            model_dir = local + model_dir[len(MODEL_DIR) :]
        revision.served, revision.port = served, free_port()
        if backend not in HF_BACKENDS:  # argparse: type=lambda t: Backend[t] raises
            error = f"__main__.py: error: argument --backend: invalid <lambda> value: '{backend}'"
            command = ["python", "-c", f"import sys; print({error!r}, file=sys.stderr); exit(2)"]
            argv: list[str] = []
        elif backend == "vllm":  # load_model: the CPU image has no vLLM
            error = (
                "Failed to start model server: Backend is set to 'vllm' but vLLM is not available"
            )
            command = ["python", "-c", f"import sys; print({error!r}, file=sys.stderr); exit(1)"]
            argv = []
        else:
            command = ["python", "-m", "kubellm.serve"]
            argv = [
                model_dir,
                "--name",
                served,
                "--host",
                "127.0.0.1",
                "--port",
                str(revision.port),
            ]
        container = {
            k: copy.deepcopy(v)
            for k, v in real.items()
            if k in ("name", "image", "env", "resources", "securityContext", "volumeMounts")
        }
        container.update(command=command, args=argv)
        return container, mount

    def _custom(
        self, container: dict[str, Any], uri: str, revision: _Revision
    ) -> tuple[dict[str, Any], tuple[dict[str, Any], dict[str, Any]] | None]:
        """A custom container with /mnt/models, --port and --host rewritten for the sim."""
        local, mount = self._local_model_dir(uri)
        revision.port = free_port()
        for k in ("command", "args"):
            if container.get(k):
                argv = [str(a).replace(MODEL_DIR, local) if uri else str(a) for a in container[k]]
                argv, _ = replace_flag(argv, "--port", str(revision.port))
                container[k], _ = replace_flag(argv, "--host", "127.0.0.1")
        for p in container.get("ports") or []:
            p["containerPort"] = revision.port
        return container, mount

    def _create_pod(
        self,
        isvc: dict[str, Any],
        revision: _Revision,
        pod: dict[str, Any],
        labels: dict[str, str] | None = None,
    ) -> None:
        meta = isvc["metadata"]
        name, ns = meta["name"], meta["namespace"]
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        revision.pod = (
            f"{revision.name}-{suffix}" if labels else f"{revision.name}-deployment-{suffix}"
        )
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": revision.pod,
                "labels": labels
                or {
                    ISVC_LABEL: name,
                    "component": "predictor",
                    REVISION_LABEL: revision.name,
                    "serving.knative.dev/configuration": f"{name}-predictor",
                    "serving.knative.dev/service": f"{name}-predictor",
                    "app": revision.name,
                },
                "annotations": pod["annotations"],
                "ownerReferences": [owner_reference(isvc)],
            },
            "spec": pod["spec"],
        }
        try:
            self.fake.create_object("pods", body, ns)
        except ApiError as e:
            self.sim.errors.append(f"{self.name}: predictor pod for {name}: {e}")
            revision.failed, revision.log_tail = True, str(e)

    def _observe(self, isvc: dict[str, Any], state: _State) -> bool:
        """Probe the revisions that run; whether any is still on its way (requeue)."""
        ns = isvc["metadata"]["namespace"]
        busy = False
        for rev in state.revisions:
            if rev.failed or rev.scaled_down or not rev.pod:
                continue
            pod = self.fake.get_object("pods", rev.pod, ns)
            if pod is None:  # deleted under us: the ReplicaSet makes another
                if rev.ready:
                    self._restart(isvc, rev)
                    busy = True
                else:
                    rev.failed, rev.log_tail = True, f"pod {rev.pod} was deleted"
                continue
            phase = (pod.get("status") or {}).get("phase", "Pending")
            if phase in ("Failed", "Succeeded"):
                if not rev.ready:
                    rev.failed = True
                    log = self.fake.pod_log(ns, rev.pod)
                    rev.log_tail = " ".join(log.strip().splitlines()[-3:]) or "exited"
                    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                        terminated = (cs.get("state") or {}).get("terminated") or {}
                        rev.exit_code = terminated.get("exitCode", rev.exit_code)
                continue
            if phase == "Running" and not rev.ready:
                rev.ready = self._probe(rev)
            busy = busy or not rev.ready
        return busy

    def _restart(self, isvc: dict[str, Any], rev: _Revision) -> None:
        """A new pod for a revision (its own spec, not the current one), on a new port."""
        with contextlib.suppress(_CannotRun):
            self._create_pod(isvc, rev, self._pod(isvc, rev, rev.predictor, rev.runtime))

    @staticmethod
    def _probe(rev: _Revision) -> bool:
        url = f"http://127.0.0.1:{rev.port}/v1/models/{rev.served}"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _scale_down(self, isvc: dict[str, Any], state: _State, ksvc: dict[str, Any]) -> None:
        """Knative scales a revision no route references to zero (min-scale only holds for
        routable revisions); the latest created one is being rolled out."""
        keep = {t.get("revisionName") for t in ksvc["traffic"]} | {state.revisions[-1].name}
        for rev in state.revisions:
            if rev.name not in keep and rev.pod and not rev.scaled_down:
                rev.scaled_down = True
                with contextlib.suppress(ApiError):
                    self.fake.delete_object("pods", rev.pod, isvc["metadata"]["namespace"])

    # ------------------------------------------------------------ Knative's status

    def _knative_service(
        self, isvc: dict[str, Any], state: _State, traffic: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The Knative Service's status: configuration, route (traffic resolved), Ready."""
        latest = state.revisions[-1]
        config = f"{isvc['metadata']['name']}-predictor"
        by_name = {r.name: r for r in state.revisions}
        resolved = []
        for t in traffic:
            name = state.latest_ready if t.get("latestRevision") else t.get("revisionName", "")
            rev = by_name.get(name)
            if rev is None or not rev.ready:
                resolved = []
                break
            entry = {k: v for k, v in t.items() if k in ("tag", "latestRevision", "percent")}
            entry["revisionName"] = name
            if t.get("tag"):
                entry["url"] = f"http://127.0.0.1:{rev.port}"
            resolved.append(entry)
        if resolved:
            state.route = resolved
        if latest.failed:
            message = f"Container failed with: {latest.log_tail}"
            configuration = (
                "False",
                "RevisionFailed",
                f'Revision "{latest.name}" failed with message: {message}.',
            )
        elif state.latest_ready == latest.name:
            configuration = ("True", "", "")
        else:
            configuration = ("Unknown", "", "")
        if resolved:
            route = ("True", "", "")
        elif latest.failed and not state.latest_ready:
            route = (
                "False",
                "RevisionMissing",
                f'Configuration "{config}" does not have any ready Revision.',
            )
        else:
            route = (
                "Unknown",
                "RevisionMissing",
                f'Configuration "{config}" is waiting for a Revision to become ready.',
            )
        worst = [c for c in (configuration, route) if c[0] == "False"] or [
            c for c in (route, configuration) if c[0] == "Unknown"
        ]
        ready = worst[0] if worst else ("True", "", "")
        shares: dict[str, int] = {}
        for t in state.route:
            shares[t["revisionName"]] = shares.get(t["revisionName"], 0) + int(t["percent"])
        rolled = [t["revisionName"] for t in state.route if not t.get("latestRevision")]
        url = ""
        if shares:
            # the sim's route: the revision with the larger share (the rolled-out one on a tie)
            best = max(shares.values())
            winners = [r for r, s in shares.items() if s == best]
            pick = next((r for r in winners if r in rolled), winners[0])
            url = f"http://127.0.0.1:{by_name[pick].port}"
        return {
            "latestCreatedRevisionName": latest.name,
            "latestReadyRevisionName": state.latest_ready,
            "traffic": copy.deepcopy(state.route),
            "url": url,
            "ready": ready[0] == "True" and bool(url),
            "conditions": {
                "Ready": ready,
                "RoutesReady": route,
                "ConfigurationsReady": configuration,
            },
        }

    @staticmethod
    def _set_conditions(status: dict[str, Any], conds: dict[str, tuple[str, str, str]]) -> None:
        """Set conditions, and Ready from PredictorReady and IngressReady (the living
        condition set of inference_service_status.go), sorted by type as knative.dev/pkg."""
        current = {c["type"]: c for c in status.get("conditions") or []}
        for ctype, (cstatus, reason, message) in conds.items():
            current[ctype] = _cond(ctype, cstatus, reason, message)
        deps = [current.get(t) for t in ("PredictorReady", "IngressReady")]
        false = [c for c in deps if c and c["status"] == "False"]
        unknown = [c for c in deps if not c or c["status"] == "Unknown"]
        if false or unknown:
            source = (false or unknown)[0] or {}
            current["Ready"] = _cond(
                "Ready",
                "False" if false else "Unknown",
                source.get("reason", ""),
                source.get("message", ""),
            )
        else:
            current["Ready"] = _cond("Ready", "True")
        status["conditions"] = [current[t] for t in sorted(current)]

    def _conditions(self, status: dict[str, Any], ksvc: dict[str, Any]) -> None:
        k = ksvc["conditions"]
        conds = {
            "PredictorReady": k["Ready"],
            "PredictorRouteReady": k["RoutesReady"],
            "PredictorConfigurationReady": k["ConfigurationsReady"],
            # controller.go PropagateCrossComponentStatus for the one component
            "RoutesReady": self._cross(k["RoutesReady"], "PredictorRouteReady"),
            "LatestDeploymentReady": self._cross(
                k["ConfigurationsReady"], "PredictorConfigurationReady"
            ),
            "Stopped": ("False", "", ""),
        }
        # the ingress reconciler: ready once the predictor has served
        ingress = find_condition(status, "IngressReady") or {}
        if ksvc["ready"] or ingress.get("status") == "True":
            conds["IngressReady"] = ("True", "", "")
        self._set_conditions(status, conds)

    @staticmethod
    def _cross(cond: tuple[str, str, str], name: str) -> tuple[str, str, str]:
        return cond if cond[0] == "True" else (cond[0], f"{name} not ready", "")

    # ------------------------------------------------------------ model status

    @staticmethod
    def _model_status(
        status: dict[str, Any], latest: _Revision, ksvc: dict[str, Any]
    ) -> dict[str, Any]:
        """inference_service_status.go PropagateModelStatus, for the latest created revision."""
        model = copy.deepcopy(status.get("modelStatus") or {})
        copies = model.setdefault("copies", {"failedCopies": 0})
        running = latest.ready and not latest.failed
        copies["totalCopies"] = 1 if running else 0
        if not copies["totalCopies"]:
            copies.pop("totalCopies")

        def update(state: str, info: dict[str, Any] | None = None) -> None:
            model_transition(model, state, info)

        ready = find_condition(status, "Ready") or {}
        if not latest.pod:  # no pods: failed if a Knative condition is False (no new info)
            false = any(c[0] == "False" for c in ksvc["conditions"].values())
            update("FailedToLoad" if false else "Pending")
        elif ready.get("status") == "True" and latest.name == ksvc["latestReadyRevisionName"]:
            update("Loaded")
        elif latest.failed:
            info: dict[str, Any] = {"reason": "ModelLoadFailed", "message": latest.log_tail}
            if latest.exit_code is not None:
                info["exitCode"] = latest.exit_code
            update("FailedToLoad", info)
        else:
            update("Pending")
        return model

    def _invalid_spec(self, status: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
        """UpdateModelTransitionStatus(InvalidSpec, ...): conditions as they were."""
        model = copy.deepcopy(status.get("modelStatus") or {})
        model["transitionStatus"] = "InvalidSpec"
        model.setdefault("states", {"activeModelState": ""})["targetModelState"] = "FailedToLoad"
        model["lastFailureInfo"] = {"reason": reason, "message": message}
        status["modelStatus"] = model
        return status

    def _write(self, key: Key, isvc: dict[str, Any], status: dict[str, Any]) -> None:
        old = isvc.get("status") or {}
        same = {k: v for k, v in status.items() if k != "conditions"} == {
            k: v for k, v in old.items() if k != "conditions"
        } and [
            (c["type"], c["status"], c.get("reason"), c.get("message"))
            for c in status.get("conditions", [])
        ] == [
            (c["type"], c["status"], c.get("reason"), c.get("message"))
            for c in old.get("conditions") or []
        ]
        if same:
            return
        for c in status.get("conditions") or []:  # keep transition times of unchanged ones
            prior = find_condition(old, c["type"])
            if prior and prior.get("status") == c["status"] and "lastTransitionTime" in prior:
                c["lastTransitionTime"] = prior["lastTransitionTime"]
        with contextlib.suppress(ApiError):
            self.fake.set_status(key[0], key[2], status, namespace=key[1])


class _CannotRun(Exception):
    """The sim cannot start this revision (the message is its failure)."""
