"""The simulated cluster's Kubeflow Trainer v2 controller: trainer.kubeflow.org/v1alpha1
TrainJob with ClusterTrainingRuntime, run as a JobSet (jobset.py).

A FAKE, for tests only. It follows kubeflow/trainer at tag v2.3.0 (commit 658725bd) and cites
the code each behaviour comes from (paths at that tag). tests/fakes/UPSTREAM.md has one row
per rule.

- the validating webhook (pkg/webhooks/trainjob_webhook.go ValidateCreate, pkg/runtime/core/
  clustertrainingruntime.go ValidateObjects L99-108): a TrainJob whose runtimeRef names a
  ClusterTrainingRuntime that does not exist is refused at create, 403
  `admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request:
  spec.RuntimeRef: Invalid value: ...: clustertrainingruntimes.trainer.kubeflow.org "x" not
  found: specified clusterTrainingRuntime must be created before the TrainJob is created`
  (controller-runtime's admission.Denied is 403; the sim renders the value as JSON, upstream
  as Go's %#v). A runtimeRef kind other than ClusterTrainingRuntime / TrainingRuntime of
  group trainer.kubeflow.org is `unsupported runtime: <Kind>.<group>`.
- the controller (pkg/controller/trainjob_controller.go Reconcile L80-140): an unsupported
  runtimeRef sets Failed (reason `TrainingRuntimeNotSupported`, `unsupported runtime: ...`);
  a runtime deleted after the TrainJob was admitted makes NewObjects fail (clustertraining
  runtime.go L59-70, "not found ClusterTrainingRuntime specified in TrainJob"): an event
  only, no condition and no JobSet, retried (the sim every second).
- the JobSet (pkg/runtime/framework/plugins/jobset/jobset.go Build L325-436, builder.go
  Trainer): named as the TrainJob, the runtime's spec.template (labels, annotations, spec)
  with, in the replicated Job labelled `trainer.kubeflow.org/trainjob-ancestor-step: trainer`,
  replicas 1, parallelism = completions = numNodes (the TrainJob's trainer.numNodes, else
  the runtime's mlPolicy.numNodes; SyncParallelCount), and in its `node` container the
  TrainJob's image, command, args (each when set), resourcesPerNode as resources, env
  upserted; spec.suspend is the TrainJob's; a controller ownerReference to the TrainJob (so
  deleting the TrainJob deletes the JobSet, its Jobs and pods). An existing JobSet is left
  alone unless the TrainJob or the JobSet is suspended (Build L336-342), then rebuilt.
- the torch plugin (pkg/runtime/framework/plugins/torch/torch.go EnforceMLPolicy), for a
  runtime with mlPolicy.torch: upserted into the `node` container after the trainer env:
  PET_NNODES (numNodes), PET_NPROC_PER_NODE (trainer.numProcPerNode, else "auto", and with
  no GPU in resourcesPerNode "auto" becomes max(1, the CPU request, else limit, rounded up)),
  PET_NODE_RANK (fieldRef metadata.annotations['batch.kubernetes.io/job-completion-index']),
  PET_MASTER_ADDR, PET_MASTER_PORT; the container port 29500. Sim difference, as in
  training_operator.py: PET_MASTER_ADDR is 127.0.0.1, not `<job>-node-0-0.<job>` (the pod's
  DNS name through the JobSet's headless Service), and the port is a free port per TrainJob,
  not 29500, so jobs can run side by side on one machine.
- status (trainjob_controller.go setSuspendedCondition L213-234, jobset.go Status L438-473):
  Suspended True (`Suspended`, "TrainJob is suspended") while spec.suspend, then False
  (`Resumed`, "TrainJob is resumed"); Complete and Failed copied from the JobSet's Completed
  and Failed conditions (their reason and message: `AllJobsCompleted` "jobset completed
  successfully", `ReachedMaxRestarts` "jobset failed due to reaching max number of restarts
  (first failed job: <job>)", ...); jobsStatus from the JobSet's replicatedJobsStatus.

- runtimePatches (pkg/runtime/core/trainingruntime.go newRuntimeInfo L144-L165,
  mergeRuntimePatches L251-L290): in order, each patch's template metadata labels and
  annotations join the JobSet's, and its template spec is strategic-merged into the runtime's
  JobSet spec (replicatedJobs by name, containers by name, env by name, ...), before the
  trainer fields and the torch env are applied.

- activeDeadlineSeconds (trainjob_controller.go reconcileDeadline L155-L191): counted from
  creationTimestamp or the last resume; past it, Failed `DeadlineExceeded` "TrainJob exceeded
  its active deadline", the JobSet deleted; the Failed condition is kept on later reconciles.

SIMPLIFIED: TrainingRuntime (namespaced), initializer, podGroupPolicy,
torchtune, envInjection and managedBy are not simulated (a TrainJob
that uses one is a sim error, never silently ignored); resourcesPerNode replaces the
container's resources (no merge); apply (server-side) is a create or a replace; the strategic
merge knows only the merge keys in MERGE_KEYS and no $patch directives; the webhook's
runtimePatches checks (jobset.go Validate L172-L250: immutability while running) are not
simulated.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import time
from collections.abc import Iterable
from typing import Any

from .fake_k8s import ApiError, Event, owner_reference, status_body
from .jobset import collect_if_orphaned, set_condition
from .sim_base import Controller, Key, find_condition, free_port, is_true, parse_time

GROUP = "trainer.kubeflow.org"
VALIDATOR = "validator.trainjob.trainer.kubeflow.org"
RUNTIME_VALIDATOR = "validator.clustertrainingruntime.trainer.kubeflow.org"
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
NODE = "node"
TRAINER_PORT = 29500  # pkg/constants/constants.go ContainerTrainerPort
COMPLETION_INDEX_PATH = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
SUPPORTED = ("ClusterTrainingRuntime", "TrainingRuntime")
# patchMergeKey of the lists a runtime patch can reach (JobSetSpec.replicatedJobs, and
# core/v1 PodSpec/Container); every other list is replaced, as strategic merge patch does.
MERGE_KEYS = {
    "replicatedJobs": "name",
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "schedulingGates": "name",
}


def strategic_merge(target: Any, patch: Any, field: str = "") -> Any:
    """A strategic merge patch (apimachinery strategicpatch) restricted to what a runtime patch
    carries: maps merge (null deletes), lists with a patchMergeKey merge item by item (new items
    appended), other lists and scalars are replaced. No $patch / $retainKeys directives."""
    if isinstance(patch, dict) and isinstance(target, dict):
        out = copy.deepcopy(target)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = strategic_merge(out.get(k), v, k)
        return out
    key = MERGE_KEYS.get(field)
    if key and isinstance(patch, list) and isinstance(target, list):
        out = copy.deepcopy(target)
        for item in patch:
            for i, old in enumerate(out):
                if isinstance(old, dict) and old.get(key) == item.get(key):
                    out[i] = strategic_merge(old, item)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def runtime_key(tj: dict[str, Any]) -> tuple[str, str, str]:
    """RuntimeRefToRuntimeRegistryKey with the CRD's defaults: (Kind.group, kind, name)."""
    ref = (tj.get("spec") or {}).get("runtimeRef") or {}
    kind = ref.get("kind", "ClusterTrainingRuntime")
    group = ref.get("apiGroup", GROUP)
    return f"{kind}.{group}", kind if group == GROUP else "", ref.get("name", "")


def upsert_env(env: list[dict[str, Any]], *items: dict[str, Any]) -> None:
    """apply.UpsertEnvVars: replace a variable of the same name in place, else append."""
    for item in items:
        for i, e in enumerate(env):
            if e.get("name") == item["name"]:
                env[i] = copy.deepcopy(item)
                break
        else:
            env.append(copy.deepcopy(item))


def cpu_count(value: Any) -> int:
    """resource.Quantity.Value() of a cpu quantity (rounded up)."""
    text = str(value)
    return math.ceil(int(text[:-1]) / 1000) if text.endswith("m") else math.ceil(float(text))


# torch.go#L68-L76 (constants.go TorchRunReservedEnvNames): refused in spec.trainer.env.
TORCH_RESERVED_ENV = (
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_NPROC_PER_NODE",
)
RFC1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def invalid(path: str, value: Any, detail: str) -> str:
    """field.Invalid(path, value, detail).Error(), the value as JSON (upstream: Go's %#v)."""
    return f"{path}: Invalid value: {json.dumps(value, sort_keys=True)}: {detail}"


def aggregate(errors: list[str]) -> str:
    """utilerrors.NewAggregate(...).Error(): one error as it is, more in brackets."""
    return errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"


def replicated_jobs(runtime: dict[str, Any]) -> list[dict[str, Any]]:
    template = (runtime.get("spec") or {}).get("template") or {}
    return list((template.get("spec") or {}).get("replicatedJobs") or [])


def pod_of(rjob: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """A replicated Job's (or its patch's) pod spec containers and initContainers."""
    job = (rjob.get("template") or {}).get("spec") or {}
    pod = (job.get("template") or {}).get("spec") or {}
    return {f: list(pod.get(f) or []) for f in ("containers", "initContainers")}


def trainjob_name_errors(body: dict[str, Any]) -> list[str]:
    """The TrainJob CRD's CEL rules on metadata.name (trainjob_types.go#L36-L37): an RFC 1035
    label of at most 63 characters."""
    name = str((body.get("metadata") or {}).get("name") or "")
    errors = []
    if not RFC1035.fullmatch(name):
        errors.append("metadata.name must match RFC 1035 DNS label format")
    if len(name) > 63:
        errors.append("metadata.name must be no more than 63 characters")
    return errors


def trainjob_webhook_errors(body: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """What the validating webhook refuses of a TrainJob on `runtime` (runtime.ValidateObjects:
    each plugin's Validate): the torch plugin's reserved env (torch.go#L66-L77), and the
    JobSet plugin's runtime patch targets (jobset.go#L176-L206: replicated jobs and
    containers the runtime has; no env for the node and initializer containers)."""
    spec = body.get("spec") or {}
    errors = []
    env = (spec.get("trainer") or {}).get("env") or []
    reserved = sorted({e.get("name") for e in env} & set(TORCH_RESERVED_ENV))
    if "torch" in ((runtime.get("spec") or {}).get("mlPolicy") or {}) and reserved:
        errors.append(
            invalid(
                "spec.trainer.env",
                env,
                f"must not have reserved envs, invalid envs configured: [{' '.join(reserved)}]",
            )
        )
    rjobs = {
        r["name"]: {c["name"] for f in ("containers", "initContainers") for c in pod_of(r)[f]}
        for r in replicated_jobs(runtime)
    }
    patches = spec.get("runtimePatches") or []
    for patch in patches:
        template = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        for rjob in (template.get("spec") or {}).get("replicatedJobs") or []:
            if rjob.get("name") not in rjobs:
                errors.append(
                    invalid(
                        "spec.runtimePatches",
                        patches,
                        "must not have replicated job that doesn't exist in the runtime job "
                        "template",
                    )
                )
                continue
            pod = pod_of(rjob)
            for kind, field in (("initContainer", "initContainers"), ("container", "containers")):
                for c in pod[field]:
                    if c.get("name") not in rjobs[rjob["name"]]:
                        errors.append(
                            invalid(
                                "spec.runtimePatches",
                                patches,
                                f"must not have {kind} that doesn't exist in the runtime job "
                                f"{rjob['name']}",
                            )
                        )
                    elif (
                        field == "containers"
                        and c.get("env")
                        and c.get("name") in ("dataset-initializer", "model-initializer", NODE)
                    ):
                        errors.append(
                            invalid(
                                "spec.runtimePatches",
                                patches,
                                "must not have envs for the dataset-initializer, "
                                "model-initializer, node containers",
                            )
                        )
    return errors


def runtime_webhook_errors(runtime: dict[str, Any]) -> list[str]:
    """trainingruntime_webhook.go validateReplicatedJobs L66-L105 (the ClusterTrainingRuntime
    webhook calls it too): a replicatedJob labelled as an ancestor has replicas 1 and its
    container (`node` for the trainer)."""
    expected = {"trainer": NODE, "model-initializer": "model-initializer"}
    expected["dataset-initializer"] = "dataset-initializer"
    errors = []
    base = "spec.template.spec.replicatedJobs"
    for idx, rjob in enumerate(replicated_jobs(runtime)):
        template = rjob.get("template") or {}
        ancestor = ((template.get("metadata") or {}).get("labels") or {}).get(ANCESTOR)
        if ancestor not in expected:
            continue
        replicas = int(rjob.get("replicas", 1))
        if replicas != 1:
            errors.append(invalid(f"{base}[{idx}].replicas", replicas, "always must be 1"))
        containers = pod_of(rjob)["containers"]
        if expected[ancestor] not in {c.get("name") for c in containers}:
            errors.append(
                invalid(
                    f"{base}[{idx}].template.spec.template.spec.containers",
                    containers,
                    f"must contain the required container for the ancestor: {ancestor}",
                )
            )
    return errors


class TrainerV2(Controller):
    name = "trainer-v2"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._ports: dict[str, int] = {}  # TrainJob uid -> its master port

    def start(self) -> None:
        self.fake.on_validate("trainjobs", self._validate)
        self.fake.on_validate("clustertrainingruntimes", self._validate_runtime)
        super().start()

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.plural == "trainjobs":
            return [] if event.type == "DELETED" else self.own_key(event, "trainjobs")
        if event.plural == "jobsets":
            return self.owner_key(event, "TrainJob")
        return []

    # ------------------------------------------------------------ the webhook

    def _validate(
        self, _fake: Any, body: dict[str, Any], old: dict[str, Any] | None, ns: str
    ) -> None:
        named = trainjob_name_errors(body)
        if named:  # the CRD's CEL rules, which the API server checks before any webhook
            tj = (body.get("metadata") or {}).get("name")
            details = ", ".join(f'<nil>: Invalid value: "object": {e}' for e in named)
            message = f'TrainJob.{GROUP} "{tj}" is invalid: {details}'
            raise ApiError(422, status_body(422, "Invalid", message))
        registry, kind, name = runtime_key(body)
        if kind not in SUPPORTED:
            why = f"unsupported runtime: {registry}"
        elif kind == "ClusterTrainingRuntime":
            runtime = self.fake.get_object("clustertrainingruntimes", name)
            if runtime is not None:
                errors = trainjob_webhook_errors(body, runtime)
                if not errors:
                    return
                why = aggregate(errors)
                message = f'admission webhook "{VALIDATOR}" denied the request: {why}'
                raise ApiError(403, status_body(403, "Forbidden", message))
            ref = (body.get("spec") or {}).get("runtimeRef")
            why = (
                f"spec.RuntimeRef: Invalid value: {json.dumps(ref)}: "
                f'clustertrainingruntimes.{GROUP} "{name}" not found: specified '
                "clusterTrainingRuntime must be created before the TrainJob is created"
            )
        else:
            return  # TrainingRuntime: refused by the controller below (not simulated)
        message = f'admission webhook "{VALIDATOR}" denied the request: {why}'
        raise ApiError(403, status_body(403, "Forbidden", message))

    def _validate_runtime(
        self, _fake: Any, body: dict[str, Any], old: dict[str, Any] | None, ns: str
    ) -> None:
        errors = runtime_webhook_errors(body)
        if errors:
            message = (
                f'admission webhook "{RUNTIME_VALIDATOR}" denied the request: {aggregate(errors)}'
            )
            raise ApiError(403, status_body(403, "Forbidden", message))

    # ------------------------------------------------------------ reconcile

    def reconcile(self, key: Key) -> None:
        tj = self.get(key)
        if tj is None:
            return
        spec = tj.get("spec") or {}
        unsupported = [f for f in ("initializer",) if spec.get(f)]
        if spec.get("managedBy") not in (None, "trainer.kubeflow.org/trainjob-controller"):
            return  # IsManagedByExternalController
        registry, kind, name = runtime_key(tj)
        if kind == "TrainingRuntime":
            unsupported.append("runtimeRef kind TrainingRuntime")
        if unsupported:
            self.sim.errors.append(f"{self.name} {key}: not simulated: {unsupported}")
            return
        status = copy.deepcopy(tj.get("status") or {})
        before = copy.deepcopy(status)
        failed = find_condition(status, "Failed")
        if failed and failed.get("reason") != "DeadlineExceeded":  # removeFailedCondition
            status["conditions"] = [c for c in status["conditions"] if c["type"] != "Failed"]
        finished = is_true(before, "Complete") or is_true(before, "Failed")
        if kind not in SUPPORTED:
            set_condition(
                status,
                "Failed",
                "True",
                "TrainingRuntimeNotSupported",
                f"unsupported runtime: {registry}",
            )
        elif not finished:
            runtime = self.fake.get_object("clustertrainingruntimes", name)
            if runtime is None:
                # NewObjects: errorNotFoundSpecifiedClusterTrainingRuntime; an event only
                self.requeue(key, 1.0)
            else:
                self._reconcile_jobset(tj, runtime)
        if spec.get("suspend"):  # setSuspendedCondition
            set_condition(status, "Suspended", "True", "Suspended", "TrainJob is suspended")
        elif is_true(status, "Suspended"):
            set_condition(status, "Suspended", "False", "Resumed", "TrainJob is resumed")
        if kind in SUPPORTED:
            self._status_from_jobset(tj, status)
        self._deadline(key, tj, status)
        if status != before:
            with contextlib.suppress(ApiError):
                self.fake.set_status(key[0], key[2], status, namespace=key[1])

    def _deadline(self, key: Key, tj: dict[str, Any], status: dict[str, Any]) -> None:
        """trainjob_controller.go reconcileDeadline L155-L191: activeDeadlineSeconds counts
        from creationTimestamp, or from the Suspended False condition's lastTransitionTime
        (a resume); past it the TrainJob is Failed, reason DeadlineExceeded ("TrainJob
        exceeded its active deadline", constants.go L87-L88), and its JobSet deleted (its
        Jobs and pods go with it); before it, a requeue at the deadline. Not while suspended
        or finished, nor without a deadline."""
        spec, meta = tj.get("spec") or {}, tj["metadata"]
        seconds = int(spec.get("activeDeadlineSeconds") or 0)
        if not seconds or spec.get("suspend"):
            return
        if is_true(status, "Complete") or is_true(status, "Failed"):
            return
        resumed = find_condition(status, "Suspended")
        start = parse_time(
            resumed.get("lastTransitionTime")
            if resumed and resumed.get("status") == "False"
            else meta.get("creationTimestamp")
        )
        if start is None:
            return
        left = start + seconds - time.time()
        if left > 0:
            self.requeue(key, left)
            return
        set_condition(
            status, "Failed", "True", "DeadlineExceeded", "TrainJob exceeded its active deadline"
        )
        with contextlib.suppress(ApiError):
            self.fake.delete_object("jobsets", meta["name"], meta["namespace"])

    def _status_from_jobset(self, tj: dict[str, Any], status: dict[str, Any]) -> None:
        """plugins/jobset/jobset.go Status."""
        meta = tj["metadata"]
        js = self.fake.get_object("jobsets", meta["name"], meta["namespace"])
        if js is None:
            return
        jstatus = js.get("status") or {}
        for js_type, tj_type in (("Completed", "Complete"), ("Failed", "Failed")):
            cond = find_condition(jstatus, js_type)
            if cond and cond.get("status") == "True":
                conds = [c for c in status.get("conditions") or [] if c["type"] != tj_type]
                status["conditions"] = [*conds, {**cond, "type": tj_type}]
        jobs = [
            {k: r.get(k, 0) for k in ("ready", "succeeded", "failed", "active", "suspended")}
            | {"name": r["name"]}
            for r in jstatus.get("replicatedJobsStatus") or []
        ]
        if jobs:
            status["jobsStatus"] = jobs

    # ------------------------------------------------------------ the JobSet

    def _reconcile_jobset(self, tj: dict[str, Any], runtime: dict[str, Any]) -> None:
        meta = tj["metadata"]
        suspend = bool((tj.get("spec") or {}).get("suspend"))
        old = self.fake.get_object("jobsets", meta["name"], meta["namespace"])
        if old is not None and not suspend and not (old.get("spec") or {}).get("suspend"):
            return  # Build L336-342: a running JobSet is not updated
        body = self._build(tj, runtime)
        if old is None:
            try:
                self.fake.create_object("jobsets", body, meta["namespace"])
            except ApiError as e:
                if e.code != 409:
                    self.sim.errors.append(f"{self.name}: creating JobSet {meta['name']}: {e}")
                return
            collect_if_orphaned(self.fake, "trainjobs", tj, "jobsets", meta["name"])
            return
        if body["spec"] == old.get("spec"):
            return
        errors = self.fake.validate("jobsets", body)
        if errors:
            self.sim.errors.append(f"{self.name}: JobSet {meta['name']} invalid: {errors}")
            return
        self.fake.put_object("jobsets", {**old, "spec": body["spec"]})

    def _build(self, tj: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
        meta = tj["metadata"]
        rspec = runtime.get("spec") or {}
        template = self._patched(tj, copy.deepcopy(rspec.get("template") or {}))
        js_spec = template.get("spec") or {}
        trainer = (tj.get("spec") or {}).get("trainer") or {}
        ml = rspec.get("mlPolicy") or {}
        num_nodes = int(trainer.get("numNodes", ml.get("numNodes", 1)))
        for rjob in js_spec.get("replicatedJobs") or []:
            labels = ((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if labels.get(ANCESTOR) != "trainer":
                continue
            rjob["replicas"] = 1
            jspec = rjob["template"].setdefault("spec", {})
            jspec["parallelism"] = jspec["completions"] = num_nodes
            pod_spec = jspec.setdefault("template", {}).setdefault("spec", {})
            for container in pod_spec.get("containers") or []:
                if container.get("name") == NODE:
                    self._node_container(tj, container, trainer, ml, num_nodes)
        tmeta = template.get("metadata") or {}
        js_meta: dict[str, Any] = {"name": meta["name"]}
        for field in ("labels", "annotations"):
            if tmeta.get(field):
                js_meta[field] = dict(tmeta[field])
        js_meta["ownerReferences"] = [owner_reference(tj)]
        return {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": js_meta,
            "spec": {**js_spec, "suspend": bool((tj.get("spec") or {}).get("suspend"))},
        }

    @staticmethod
    def _patched(tj: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
        """core/trainingruntime.go newRuntimeInfo L144-L165 and mergeRuntimePatches L251-L290:
        each patch's metadata labels and annotations are added to the JobSet's, its spec
        strategic-merged into the JobSet spec, in order; replicatedJobs keep the runtime's
        order."""
        meta = template.setdefault("metadata", {})
        spec = template.get("spec") or {}
        order = {r["name"]: i for i, r in enumerate(spec.get("replicatedJobs") or [])}
        for patch in (tj.get("spec") or {}).get("runtimePatches") or []:
            ptemplate = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
            for field in ("labels", "annotations"):
                extra = (ptemplate.get("metadata") or {}).get(field)
                if extra:
                    meta[field] = {**(meta.get(field) or {}), **extra}
            if ptemplate.get("spec") is not None:
                spec = strategic_merge(spec, ptemplate["spec"])
        if spec.get("replicatedJobs"):
            spec["replicatedJobs"].sort(key=lambda r: order.get(r["name"], 0))
        template["spec"] = spec
        return template

    def _node_container(
        self,
        tj: dict[str, Any],
        container: dict[str, Any],
        trainer: dict[str, Any],
        ml: dict[str, Any],
        num_nodes: int,
    ) -> None:
        for field in ("image", "command", "args"):
            if trainer.get(field) is not None:
                container[field] = copy.deepcopy(trainer[field])
        resources = trainer.get("resourcesPerNode") or container.get("resources") or {}
        if trainer.get("resourcesPerNode") is not None:
            container["resources"] = copy.deepcopy(resources)
        env = container.setdefault("env", [])
        upsert_env(env, *(trainer.get("env") or []))
        if "torch" not in ml:
            return
        nproc: str = str(trainer.get("numProcPerNode", "auto"))
        gpus = int(((resources.get("limits") or {}).get("nvidia.com/gpu")) or 0)
        if nproc == "auto" and gpus == 0:
            cpu = (resources.get("requests") or {}).get("cpu") or (
                resources.get("limits") or {}
            ).get("cpu")
            nproc = str(max(1, cpu_count(cpu) if cpu else 0))
        port = self._ports.setdefault(tj["metadata"]["uid"], free_port())
        upsert_env(
            env,
            {"name": "PET_NNODES", "value": str(num_nodes)},
            {"name": "PET_NPROC_PER_NODE", "value": nproc},
            {
                "name": "PET_NODE_RANK",
                "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_PATH}},
            },
            {"name": "PET_MASTER_ADDR", "value": "127.0.0.1"},
            {"name": "PET_MASTER_PORT", "value": str(port)},
        )
        ports = container.setdefault("ports", [])
        if not any(p.get("containerPort") == TRAINER_PORT for p in ports):
            ports.append({"containerPort": TRAINER_PORT})
