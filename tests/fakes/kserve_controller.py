"""The simulated cluster's KServe: serving.kserve.io/v1beta1 InferenceService in Knative mode.

A FAKE, for tests only. It does what KServe's controller and the Knative Serving it drives do
for one predictor, each rule following a file of kserve/kserve (at the commit the vendored
CRDs pin, tests/fixtures/crds/README.md) or knative/serving:

- deployment mode (pkg/controller/v1beta1/inferenceservice/utils/utils.go GetDeploymentMode):
  status.deploymentMode, else the `serving.kserve.io/deploymentMode` annotation (legacy names
  normalized), else the configured default, `Serverless` in KServe's shipped
  config/configmap/inferenceservice.yaml. The sim is Knative mode only: any other mode is a
  sim error (`sim.errors`), never a silent change of behaviour.
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
- not simulated: admission of updates against the old object (validateDeploymentMode,
  validatePredictorNameChange), Standard mode's `spec.canary`, transformers, explainers,
  multi-node, storage initializer containers, scale to zero.
"""

from __future__ import annotations

import contextlib
import copy
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

from .fake_k8s import ApiError, Event, owner_reference
from .k8s_schemas import servingruntime_errors
from .sim_base import Controller, Key, find_condition, free_port, now_rfc3339

ISVC_LABEL = "serving.kserve.io/inferenceservice"
REVISION_LABEL = "serving.knative.dev/revision"
MODEL_DIR = "/mnt/models"
CONTAINER = "kserve-container"
TAG_ROUTING = "serving.kserve.io/enable-tag-routing"
DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
DEFAULT_DEPLOYMENT_MODE = "Serverless"  # config/configmap/inferenceservice.yaml
RUNTIME_CONTAINER_ANNOTATION = "sim.kubellm/runtime-container"
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


class KServe(Controller):
    name = "kserve"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._states: dict[Key, _State] = {}
        self.runtimes: dict[tuple[str, str, str], dict[str, Any]] = {}  # kind, ns, name
        self.add_runtime(yaml.safe_load(HF_RUNTIME_YAML))

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
        mode = status.get("deploymentMode") or annotations.get(DEPLOYMENT_MODE)
        mode = mode or DEFAULT_DEPLOYMENT_MODE
        status["deploymentMode"] = mode
        if parse_deployment_mode(mode) != "Knative":
            self.sim.errors.append(
                f"{self.name} {key}: deployment mode {mode}: the sim simulates Knative only"
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

    def _create_pod(self, isvc: dict[str, Any], revision: _Revision, pod: dict[str, Any]) -> None:
        meta = isvc["metadata"]
        name, ns = meta["name"], meta["namespace"]
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        revision.pod = f"{revision.name}-deployment-{suffix}"
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": revision.pod,
                "labels": {
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
