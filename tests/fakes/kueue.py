"""The simulated cluster's Kueue: queue-name labels, Workloads, quota and admission.

A FAKE, for tests only, of kubernetes-sigs/kueue v0.19.0, opt-in: `SimCluster(tmp_path,
kueue=KueueSettings(...))`. It plays what decides whether a PyTorchJob is gang-scheduled:
which integrations are on, which object the queue label is read from, and how many
Workloads a job becomes. Each rule cites the upstream code at v0.19.0.

Integrations (`KueueSettings.frameworks`). The default is the list Kueue's own manifests
ship (config/components/manager/controller_manager_config.yaml L46-L64, the same in
charts/kueue/values.yaml L155-L173): `kubeflow.org/pytorchjob` is commented out there, and
`pod` is on. (An empty list would be defaulted to `batch/job` alone:
apis/config/v1beta2/defaults.go L120-L122.)

With `kubeflow.org/pytorchjob` on (pkg/controller/jobs/kubeflow/jobs/pytorchjob):
- webhook (jobframework/base_webhook.go L69-L75 -> defaults.go ApplyDefaultForSuspend L37-L46
  -> utils.go WorkloadShouldBeSuspended L112-L123): a job whose queue-name label is set on
  the job itself, and that has no Kueue-managed ancestor, is created with
  `spec.runPolicy.suspend: true` (kubeflowjob_controller.go Suspend L54-L56);
- reconciler (jobframework/reconciler.go ReconcileGenericJob L296-L409): a job without the
  label on its own metadata is ignored (L363-L367); otherwise exactly one Workload
  (ensureOneWorkload L918), named `pytorchjob-<name>-<sha1[:5]>` (workload_names.go
  L64-L95), owned by the job, with one podSet per replica type present, Master first
  (kubeflowjob_controller.go PodSets L112-L120, OrderedReplicaTypes L184-L193; pytorchjob
  OrderedReplicaTypes L120-L121), named lowercase (NewPodSetReference), count = replicas
  (default 1, podsCount L234-L236);
- admission unsuspends the job (reconciler.go L600-L605 startJob -> RunWithPodSetsInfo,
  kubeflowjob_controller.go L58-L59: `runPolicy.suspend = false`); a job that runs without
  an admitted Workload is suspended again (L632-L640); a finished job (Succeeded or Failed
  condition, kubeflowjob_controller.go Finished L98-L110) finishes its Workload (L463-L475),
  which frees its quota.

With `pod` on (pkg/controller/jobs/pod), its webhook (pod_webhook.go Default L104-L195): a
pod with the queue-name label gets label `kueue.x-k8s.io/managed: "true"` and the
scheduling gate `kueue.x-k8s.io/admission` (L162-L176, constants.SchedulingGateName), unless
an ancestor is a Kueue-managed job (L145-L149: FindAncestorJobManagedByKueue,
jobframework/reconciler.go L862-L915 (L905), which counts an owner as managed only when its
integration is enabled, GetEmptyOwnerObject -> getJobTypeForOwner, and it has the label).
So a PyTorchJob's pods with the label on their template, under the default integrations,
are each their own Workload `pod-<name>-<hash>` with one podSet `main` of count 1
(pod_controller.go constructPodSet L743-L750), admitted one by one; admission removes the
gate (pod_controller.go Run L266-L291, prepare L1508-L1513), and the pod's end finishes its
Workload (Finished L361-L375). With the pytorchjob integration also on and the label on the
job, the pods are not gated (their owner is the managed ancestor).

With `trainer.kubeflow.org/trainjob` on (pkg/controller/jobs/trainjob, on in the shipped
list: controller_manager_config.yaml L59), Kueue reads Trainer's own runtime code:
- webhook (trainjob_webhook.go Default L70-L95): every TrainJob gets Kueue's own
  runtimePatches entry, manager `kueue.x-k8s.io/manager` (trainjob_controller.go L76) with
  an empty JobSet spec patch, appended after the user's; one with the queue-name label on
  its own metadata (WorkloadShouldBeSuspended) is created with `spec.suspend: true`;
- reconciler: one Workload `trainjob-<name>-<hash>` whose podSets are those of the JobSet
  Trainer would build (trainjob_controller.go PodSets L217-L241 -> getChildJobSet
  L146-L183, the runtime's replicatedJobs with the TrainJob's numNodes and runtimePatches;
  jobset_controller.go PodSets L115-L136): one per replicatedJob, named after it, count =
  replicas x min(parallelism, completions) (podsCount L241-L244, PodsCountPerReplica
  L231-L239); a TrainJob whose runtime is missing is retried (L155-L158);
- admission (RunWithPodSetsInfo L243-L290): the podSet info of the admission (labels, with
  `kueue.x-k8s.io/podset: <podSet>`, reconciler.go getPodSetsInfoFromStatus L1602;
  annotations, the flavor's nodeSelector and tolerations: podset.go FromAssignment L58-L93)
  is written as `replicatedJobs` of Kueue's runtime patch, never the user's, and the
  TrainJob unsuspended (`spec.suspend: false`); without Kueue's patch the start fails
  ("kueue runtime patch not found", L277-L280) and the TrainJob stays suspended;
- stop (Stop L292-L313, RestorePodSetsInfo L315-L322): suspended, the patch's replicatedJobs
  cleared; finished (Finished L333-L341) when its Complete or Failed condition is True.
The TrainJob's JobSet, Jobs and pods have it as their Kueue-managed ancestor
(FindAncestorJobManagedByKueue walks the whole controller chain, pod -> Job -> JobSet ->
TrainJob, and keeps the topmost managed owner): no Workload of their own, pods never gated.
No minimum Trainer version is checked at start-up in v0.19.0 (jobframework/setup.go
L72-L115 only waits for the CRD; NewReconciler L84-L95 builds Trainer v2.2.1's runtime
registry); the integration needs `spec.runtimePatches`, which Trainer's CRD has from v2.2.0
(site docs still say v2.0.0). With the integration off, a TrainJob is not Kueue's: created
unsuspended, no Workload; labelled pods (a runtime patch's label) fall to the `pod`
integration one by one.

The API server's pod strategy marks a gated pod at creation with PodScheduled=False,
reason SchedulingGated (kubernetes/kubernetes pkg/registry/core/pod/strategy.go
applySchedulingGatedCondition); the sim's scheduler (kubelet.py) leaves gated pods alone.

Admission (pkg/scheduler, one flavor): a Workload is admitted whole or not at all, when the
total of its podSets (per pod: requests, a limit standing in for a missing request,
workload/resources.go UseLimitsAsMissingRequestsInPod L124-L137; the pod's request is the
larger of its containers' sum and its largest init container, as
component-helpers' PodRequests; times count, workload.go totalRequestsFromPodSets
L616-L648; `pods` counts the pods when the ClusterQueue has a quota for it,
flavorassigner.go L684-L686) fits the ClusterQueue's unused nominal quota; a resource the
ClusterQueue has no quota for is never admitted ("resource X unavailable in ClusterQueue",
flavorassigner.go L956). Pending Workloads are tried oldest first and one that does not fit
does not block the next (BestEffortFIFO, the default: clusterqueue_types.go L105).
Admission writes status.admission and conditions QuotaReserved and Admitted True; a
Workload that does not fit gets QuotaReserved False, reason Pending, with the scheduler's
"insufficient unused quota for R in flavor F, N more needed" (flavorassigner.go L1251).

Simplified: one ResourceFlavor (`default-flavor`), one ClusterQueue per LocalQueue
(`KueueSettings.queues`: LocalQueue name -> nominal quota), LocalQueues in every namespace,
no cohorts, borrowing, preemption, priorities, admission checks, waitForPodsReady,
namespace selectors (kube-system and kueue-system are excluded upstream; the sim has
neither), finalizers, pod groups (`kueue.x-k8s.io/pod-group-name`), partial admission, TAS.
Workloads (kueue.x-k8s.io/v1beta2, the storage version at v0.19.0) are stored in the fake
API server as objects of plural `workloads` (owned by their job or pod, so the garbage
collector deletes them with it) but are not served over HTTP; tests read them with
`sim.kueue.workloads()`. The webhooks run right after the create is stored (the fake has no
admission chain), inside the same lock, so every controller sees the mutated object.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from .fake_k8s import Event, FakeK8s, owner_reference
from .sim_base import (
    Controller,
    Key,
    controller_of,
    find_condition,
    is_true,
    new_condition,
    now_rfc3339,
)

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # pkg/controller/constants/constants.go L23
MANAGED_LABEL = "kueue.x-k8s.io/managed"  # pkg/constants/constants.go L52-L53
ADMISSION_GATE = "kueue.x-k8s.io/admission"  # pkg/controller/jobs/pod/constants L24
PYTORCHJOB = "kubeflow.org/pytorchjob"  # pytorchjob_controller.go L37
TRAINJOB = "trainer.kubeflow.org/trainjob"  # trainjob_controller.go L54
JOBSET = "jobset.x-k8s.io/jobset"  # jobset_controller.go L44
BATCH_JOB = "batch/job"  # job_controller.go L53
RUNTIME_PATCH_MANAGER = "kueue.x-k8s.io/manager"  # trainjob_controller.go L76
PODSET_LABEL = "kueue.x-k8s.io/podset"  # pkg/constants/constants.go L58
# Owners FindAncestorJobManagedByKueue can walk through (integrations Kueue registers): kind ->
# (plural, integration). An owner of another kind stops the walk (reconciler.go L884-L891).
OWNER_KINDS: dict[str, tuple[str, str]] = {
    "PyTorchJob": ("pytorchjobs", PYTORCHJOB),
    "TrainJob": ("trainjobs", TRAINJOB),
    "JobSet": ("jobsets", JOBSET),
    "Job": ("jobs", BATCH_JOB),
}
POD = "pod"  # pod_controller.go L68
# config/components/manager/controller_manager_config.yaml L46-L64 @v0.19.0 (uncommented)
DEFAULT_FRAMEWORKS: tuple[str, ...] = (
    "batch/job",
    "kubeflow.org/mpijob",
    "ray.io/rayjob",
    "ray.io/raycluster",
    "ray.io/rayservice",
    "jobset.x-k8s.io/jobset",
    "workload.codeflare.dev/appwrapper",
    "trainer.kubeflow.org/trainjob",
    "pod",
    "deployment",
    "statefulset",
    "leaderworkerset.x-k8s.io/leaderworkerset",
)
WORKLOADS = "workloads"
API_VERSION = "kueue.x-k8s.io/v1beta2"
FLAVOR = "default-flavor"
_SCHEDULE: Key = ("kueue-scheduler", "", "")
_GATED = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "SchedulingGated",
    "message": "Scheduling is blocked due to non-empty scheduling gates",
}


@dataclass(frozen=True)
class KueueSettings:
    """frameworks: Kueue's `integrations.frameworks` (default: what v0.19.0's manifests
    ship, without `kubeflow.org/pytorchjob`, with `trainer.kubeflow.org/trainjob`). queues:
    LocalQueue name -> the nominal quota of the ClusterQueue behind it, e.g.
    `{"team-a": {"pods": 2, "nvidia.com/gpu": 2}}`."""

    frameworks: tuple[str, ...] = DEFAULT_FRAMEWORKS
    queues: Mapping[str, Mapping[str, str | int]] = field(default_factory=dict)

    def with_pytorchjob(self) -> KueueSettings:
        """These settings with the pytorchjob integration enabled (as the README says)."""
        return KueueSettings((*self.frameworks, PYTORCHJOB), self.queues)

    def without(self, framework: str) -> KueueSettings:
        """These settings with `framework` taken out of the integrations."""
        return KueueSettings(tuple(f for f in self.frameworks if f != framework), self.queues)


def queue_name(obj: dict[str, Any]) -> str:
    """jobframework.QueueNameForObject (utils.go L151-L153): the label on `obj` itself."""
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or "")


def workload_name(kind: str, group: str, name: str, uid: str) -> str:
    """workload_names.go GetWorkloadNameForOwnerWithGVK: `<kind>-<name>-<sha1[:5]>`."""
    digest = hashlib.sha1("\n".join([kind, group, name, uid]).encode()).hexdigest()
    return f"{kind.lower()}-{name}"[: 253 - 6] + "-" + digest[:5]


def pod_requests(spec: dict[str, Any]) -> dict[str, Decimal]:
    """One pod's requests as Kueue counts them (limits for missing requests; the larger of
    the containers' sum and the largest init container)."""

    def own(c: dict[str, Any]) -> dict[str, Decimal]:
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {k: parse_quantity(v) for k, v in merged.items()}

    total: dict[str, Decimal] = {}
    for c in spec.get("containers") or []:
        for k, v in own(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in spec.get("initContainers") or []:
        for k, v in own(c).items():
            total[k] = max(total.get(k, Decimal(0)), v)
    return total


def _fmt(value: Decimal) -> str:
    return str(value.normalize()) if value != value.to_integral() else str(int(value))


class Kueue(Controller):
    """Kueue's webhooks, job and pod reconcilers and scheduler, on one thread."""

    name = "kueue"

    def __init__(self, sim: Any, settings: KueueSettings) -> None:
        super().__init__(sim)
        self.settings = settings
        self._seq = itertools.count()
        self._order: dict[str, int] = {}  # workload uid -> creation order (FIFO)

    def enabled(self, framework: str) -> bool:
        return framework in self.settings.frameworks

    def start(self) -> None:
        self.fake.on_create("pytorchjobs", self._job_webhook)
        self.fake.on_create("trainjobs", self._trainjob_webhook)
        self.fake.on_create("pods", self._pod_webhook)
        super().start()

    # ------------------------------------------------------------ for tests

    def workloads(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """The Workloads Kueue made, oldest first."""
        out = self.fake.list_objects(WORKLOADS, namespace)
        return sorted(out, key=lambda w: self._order.get(w["metadata"]["uid"], -1))

    @staticmethod
    def admitted(workload: dict[str, Any]) -> bool:
        return is_true(workload.get("status") or {}, "Admitted")

    # ------------------------------------------------------------ webhooks (on create)

    def _job_webhook(self, fake: FakeK8s, job: dict[str, Any]) -> None:
        """base_webhook.go Default: suspend a job that carries the queue label itself."""
        if not self.enabled(PYTORCHJOB) or not queue_name(job):
            return
        run_policy = (job.get("spec") or {}).get("runPolicy") or {}
        if run_policy.get("suspend") is True:
            return
        self._set_suspend(("pytorchjobs", job["metadata"]["namespace"], job["metadata"]["name"]))

    def _trainjob_webhook(self, fake: FakeK8s, tj: dict[str, Any]) -> None:
        """trainjob_webhook.go Default L70-L95: Kueue's runtime patch on every TrainJob (the
        integration on), and `spec.suspend: true` on one that carries the queue label itself
        and has no Kueue-managed ancestor (WorkloadShouldBeSuspended, utils.go L112-L123)."""
        if not self.enabled(TRAINJOB):
            return  # a noop webhook (jobframework/setup.go L108-L111)
        suspend = bool(queue_name(tj)) and self._managed_ancestor(tj) is None
        with self.fake._lock:
            meta = tj["metadata"]
            current = self.fake.get_object("trainjobs", meta["name"], meta["namespace"])
            if current is None:
                return
            spec = current.setdefault("spec", {})
            spec.setdefault("runtimePatches", []).append(
                {
                    "manager": RUNTIME_PATCH_MANAGER,
                    "trainingRuntimeSpec": {"template": {"spec": {}}},
                }
            )
            if suspend:
                spec["suspend"] = True
            self.fake.put_object("trainjobs", current)

    def _pod_webhook(self, fake: FakeK8s, pod: dict[str, Any]) -> None:
        """pod_webhook.go Default: gate a labelled pod with no Kueue-managed ancestor."""
        if not self.enabled(POD) or self._managed_ancestor(pod) is not None:
            return
        if not queue_name(pod):  # manageJobsWithoutQueueName is false by default
            return
        meta = pod["metadata"]
        key = ("pods", meta["namespace"], meta["name"])
        current = self.fake.get_object(*_get_args(key))
        if current is None:
            return
        current["metadata"].setdefault("labels", {})[MANAGED_LABEL] = "true"
        spec = current.setdefault("spec", {})
        gates = spec.setdefault("schedulingGates", [])
        if not any(g.get("name") == ADMISSION_GATE for g in gates):
            gates.append({"name": ADMISSION_GATE})
        # The pod strategy's PrepareForCreate runs after the mutating webhooks.
        status = current.setdefault("status", {})
        conditions = status.setdefault("conditions", [])
        if not any(c.get("type") == "PodScheduled" for c in conditions):
            conditions.append({**_GATED, "lastTransitionTime": now_rfc3339()})
        self.fake.put_object("pods", current)

    def _managed_ancestor(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """FindAncestorJobManagedByKueue (reconciler.go L862-L912): walk the controller
        chain up while the owner is of a kind Kueue knows (OWNER_KINDS); the topmost owner
        whose integration is enabled and that has the queue label itself is the managed
        ancestor (a pod's Job, that Job's JobSet, that JobSet's TrainJob)."""
        ns = obj["metadata"]["namespace"]
        top: dict[str, Any] | None = None
        current, seen = obj, {obj["metadata"].get("uid")}
        while (ref := controller_of(current)) is not None and ref.get("kind") in OWNER_KINDS:
            plural, framework = OWNER_KINDS[ref["kind"]]
            parent = self.fake.get_object(plural, ref["name"], ns)
            if parent is None or parent["metadata"].get("uid") in seen or len(seen) > 10:
                return None  # ErrWorkloadOwnerNotFound, cyclic, managedOwnersChainLimit
            if self.enabled(framework) and queue_name(parent):
                top = parent
            seen.add(parent["metadata"].get("uid"))
            current = parent
        return top

    # ------------------------------------------------------------ reconcilers

    def keys_for(self, event: Event) -> Iterable[Key]:
        keys: list[Key] = []
        if event.plural in ("pytorchjobs", "trainjobs") and event.type != "DELETED":
            keys.append((event.plural, event.namespace, event.name))
        elif event.plural == "pods" and event.type != "DELETED":
            if (event.obj["metadata"].get("labels") or {}).get(MANAGED_LABEL) == "true":
                keys.append(("pods", event.namespace, event.name))
        elif event.plural == WORKLOADS:
            keys += self._owner_keys(event.obj)
        if event.plural in ("pytorchjobs", "trainjobs", "pods", WORKLOADS):
            keys.append(_SCHEDULE)  # quota may have been freed or asked for
        return keys

    @staticmethod
    def _owner_keys(workload: dict[str, Any]) -> list[Key]:
        plurals = {"PyTorchJob": "pytorchjobs", "TrainJob": "trainjobs", "Pod": "pods"}
        ns = workload["metadata"]["namespace"]
        return [
            (plurals[ref["kind"]], ns, ref["name"])
            for ref in workload["metadata"].get("ownerReferences") or []
            if ref.get("controller") and ref.get("kind") in plurals
        ]

    def reconcile(self, key: Key) -> None:
        if key == _SCHEDULE:
            self._schedule()
        elif key[0] == "pytorchjobs":
            self._reconcile_job(key)
        elif key[0] == "trainjobs":
            self._reconcile_trainjob(key)
        elif key[0] == "pods":
            self._reconcile_pod(key)

    def _reconcile_job(self, key: Key) -> None:
        job = self.get(key)
        if job is None or not self.enabled(PYTORCHJOB) or not queue_name(job):
            return  # reconciler.go L363-L367: the label must be on the job itself
        workload = self._workload_of(job)
        status = job.get("status") or {}
        if is_true(status, "Succeeded") or is_true(status, "Failed"):
            if workload is not None:
                self._finish(workload, "Succeeded" if is_true(status, "Succeeded") else "Failed")
            return
        if workload is None:
            specs = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
            pod_sets = [
                {
                    "name": rtype.lower(),
                    "count": int(specs[rtype].get("replicas", 1)),
                    "template": copy.deepcopy(specs[rtype].get("template") or {}),
                }
                for rtype in ("Master", "Worker")
                if specs.get(rtype) is not None
            ]
            self._create_workload(job, "PyTorchJob", "kubeflow.org", queue_name(job), pod_sets)
            return
        suspended = ((job.get("spec") or {}).get("runPolicy") or {}).get("suspend") is True
        if self.admitted(workload) and suspended:
            self._set_suspend(key, False)
        elif not self.admitted(workload) and not suspended:
            self._set_suspend(key, True)

    def _reconcile_trainjob(self, key: Key) -> None:
        """ReconcileGenericJob for a TrainJob (trainjob_controller.go)."""
        tj = self.get(key)
        if tj is None or not self.enabled(TRAINJOB) or not queue_name(tj):
            return  # reconciler.go L363-L367: the label must be on the TrainJob itself
        workload = self._workload_of(tj)
        status = tj.get("status") or {}
        if is_true(status, "Complete") or is_true(status, "Failed"):  # Finished L333-L341
            if workload is not None:
                self._finish(workload, "Succeeded" if is_true(status, "Complete") else "Failed")
            return
        if workload is None:
            pod_sets = self._trainjob_pod_sets(tj)
            if pod_sets is None:
                self.requeue(key, 1.0)  # "runtime '<name>' not found" (L155-L158): retried
                return
            self._create_workload(tj, "TrainJob", "trainer.kubeflow.org", queue_name(tj), pod_sets)
            return
        suspended = (tj.get("spec") or {}).get("suspend") is True
        if self.admitted(workload) and suspended:
            self._start_trainjob(key, workload)  # reconciler.go L600-L605
        elif not self.admitted(workload) and not suspended:
            self._stop_trainjob(key)  # reconciler.go L632-L640

    def _trainjob_pod_sets(self, tj: dict[str, Any]) -> list[dict[str, Any]] | None:
        """PodSets L217-L241: the podSets of the JobSet Trainer builds for `tj` (its own
        runtime code: getChildJobSet L146-L183), as the JobSet integration counts them
        (jobset_controller.go PodSets L115-L136, podsCount L241-L244); None when the runtime
        is missing."""
        from .trainer_v2 import TrainerV2, runtime_key

        _, kind, name = runtime_key(tj)
        runtime = self.fake.get_object("clustertrainingruntimes", name)
        trainer = next((c for c in self.sim.controllers if isinstance(c, TrainerV2)), None)
        if kind != "ClusterTrainingRuntime" or runtime is None or trainer is None:
            return None
        jobset = trainer._build(tj, runtime)
        pod_sets = []
        for rjob in jobset["spec"].get("replicatedJobs") or []:
            jspec = (rjob.get("template") or {}).get("spec") or {}
            parallelism = int(jspec.get("parallelism", 1))
            per_replica = min(parallelism, int(jspec.get("completions", parallelism)))
            pod_sets.append(
                {
                    "name": rjob["name"].lower(),
                    "count": int(rjob.get("replicas", 1)) * per_replica,
                    "template": copy.deepcopy(jspec.get("template") or {}),
                }
            )
        return pod_sets

    def _start_trainjob(self, key: Key, workload: dict[str, Any]) -> None:
        """RunWithPodSetsInfo L243-L290: the admission's podSet info (the podset label:
        reconciler.go getPodSetsInfoFromStatus L1583-L1625; the flavor's node labels and
        tolerations: none for the sim's one flavor) as `replicatedJobs` of Kueue's own
        runtime patch, then `spec.suspend: false`."""
        assignments = ((workload.get("status") or {}).get("admission") or {}).get(
            "podSetAssignments"
        ) or []
        patches = [
            {
                "name": a["name"],
                "template": {
                    "spec": {
                        "template": {
                            "metadata": {"labels": {PODSET_LABEL: a["name"]}},
                            "spec": {},  # nodeSelector, tolerations, schedulingGates: none
                        },
                    }
                },
            }
            for a in assignments
        ]
        with self.fake._lock:
            current = self.get(key)
            if current is None:
                return
            patch = _kueue_patch(current)
            if patch is None:
                return  # "kueue runtime patch not found" (L277-L280): an error, retried
            template = patch.setdefault("trainingRuntimeSpec", {}).setdefault("template", {})
            template.setdefault("spec", {})["replicatedJobs"] = patches
            current["spec"]["suspend"] = False
            self._put_valid("trainjobs", current)

    def _stop_trainjob(self, key: Key) -> None:
        """Stop L292-L313 with RestorePodSetsInfo L315-L322: suspend, and clear the
        replicatedJobs of Kueue's runtime patch."""
        with self.fake._lock:
            current = self.get(key)
            if current is None:
                return
            current.setdefault("spec", {})["suspend"] = True
            patch = _kueue_patch(current)
            template = ((patch or {}).get("trainingRuntimeSpec") or {}).get("template") or {}
            (template.get("spec") or {}).pop("replicatedJobs", None)
            self._put_valid("trainjobs", current)

    def _put_valid(self, plural: str, obj: dict[str, Any]) -> None:
        """An update as the API server takes it: refused (a sim error) when it does not
        validate against the CRD."""
        errors = self.fake.validate(plural, obj)
        if errors:
            self.sim.errors.append(f"{self.name}: {plural} {obj['metadata']['name']}: {errors}")
            return
        self.fake.put_object(plural, obj)

    def _reconcile_pod(self, key: Key) -> None:
        pod = self.get(key)
        if pod is None:
            return
        workload = self._workload_of(pod)
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            if workload is not None:
                self._finish(workload, phase)
            return
        if workload is None:
            spec = copy.deepcopy(pod.get("spec") or {})
            spec.pop("schedulingGates", None)
            pod_sets = [{"name": "main", "count": 1, "template": {"spec": spec}}]
            self._create_workload(pod, "Pod", "", queue_name(pod), pod_sets)
            return
        gates = (pod.get("spec") or {}).get("schedulingGates") or []
        if self.admitted(workload) and any(g.get("name") == ADMISSION_GATE for g in gates):
            with self.fake._lock:  # read-modify-write, as a patch of the live object
                current = self.get(key)
                if current is None:
                    return
                current["spec"]["schedulingGates"] = [
                    g
                    for g in current["spec"].get("schedulingGates") or []
                    if g.get("name") != ADMISSION_GATE
                ]
                if not current["spec"]["schedulingGates"]:
                    del current["spec"]["schedulingGates"]
                self.fake.put_object("pods", current)

    # ------------------------------------------------------------ workloads

    def _workload_of(self, owner: dict[str, Any]) -> dict[str, Any] | None:
        owned = self.owned(WORKLOADS, owner)
        return owned[0] if owned else None

    def _create_workload(
        self,
        owner: dict[str, Any],
        kind: str,
        group: str,
        queue: str,
        pod_sets: list[dict[str, Any]],
    ) -> None:
        meta = owner["metadata"]
        workload = {
            "apiVersion": API_VERSION,
            "kind": "Workload",
            "metadata": {
                "name": workload_name(kind, group, meta["name"], meta["uid"]),
                "namespace": meta["namespace"],
                "ownerReferences": [owner_reference(owner)],
            },
            "spec": {"queueName": queue, "podSets": pod_sets},
        }
        self.fake.put_object(WORKLOADS, workload)
        stored = self.fake.get_object(WORKLOADS, workload["metadata"]["name"], meta["namespace"])
        if stored is not None:
            self._order[stored["metadata"]["uid"]] = next(self._seq)

    def _finish(self, workload: dict[str, Any], how: str) -> None:
        status = workload.get("status") or {}
        if is_true(status, "Finished"):
            return
        self._set_condition(workload, "Finished", "True", how, f"Job {how.lower()}")

    def _set_condition(
        self, workload: dict[str, Any], ctype: str, cstatus: str, reason: str, message: str
    ) -> None:
        status = copy.deepcopy(workload.get("status") or {})
        cond = new_condition(status, ctype, cstatus, reason, message)
        if cond is None:
            return
        cond.pop("lastUpdateTime", None)
        status["conditions"] = [
            c for c in status.get("conditions") or [] if c.get("type") != ctype
        ] + [cond]
        meta = workload["metadata"]
        self.fake.set_status(WORKLOADS, meta["name"], status, namespace=meta["namespace"])

    def _set_suspend(self, key: Key, suspend: bool = True) -> None:
        """A patch of `spec.runPolicy.suspend` (the webhook's mutation or the reconciler's
        start/stop), made on the live object so a concurrent status write is kept."""
        with self.fake._lock:
            job = self.fake.get_object(*_get_args(key))
            if job is None:
                return
            job.setdefault("spec", {}).setdefault("runPolicy", {})["suspend"] = suspend
            self.fake.put_object("pytorchjobs", job)

    # ------------------------------------------------------------ scheduler

    def _usage(self, workload: dict[str, Any], quota: Mapping[str, Any]) -> dict[str, Decimal]:
        total: dict[str, Decimal] = {}
        for ps in workload["spec"]["podSets"]:
            count = int(ps["count"])
            for name, amount in pod_requests(ps["template"].get("spec") or {}).items():
                total[name] = total.get(name, Decimal(0)) + amount * count
            if "pods" in quota:
                total["pods"] = total.get("pods", Decimal(0)) + count
        return {k: v for k, v in total.items() if v > 0}

    def _schedule(self) -> None:
        workloads = self.workloads()
        used: dict[str, dict[str, Decimal]] = {}
        for w in workloads:
            status = w.get("status") or {}
            if self.admitted(w) and not is_true(status, "Finished"):
                quota = self.settings.queues.get(w["spec"]["queueName"], {})
                bucket = used.setdefault(w["spec"]["queueName"], {})
                for name, amount in self._usage(w, quota).items():
                    bucket[name] = bucket.get(name, Decimal(0)) + amount
        for w in workloads:
            status = w.get("status") or {}
            if is_true(status, "QuotaReserved") or is_true(status, "Finished"):
                continue
            queue = w["spec"]["queueName"]
            if queue not in self.settings.queues:
                self._pending(w, f"LocalQueue {queue} doesn't exist")
                continue
            quota = {k: parse_quantity(v) for k, v in self.settings.queues[queue].items()}
            need = self._usage(w, self.settings.queues[queue])
            bucket = used.setdefault(queue, {})
            why = []
            for name, amount in sorted(need.items()):
                if name not in quota:
                    why.append(f"resource {name} unavailable in ClusterQueue")
                elif bucket.get(name, Decimal(0)) + amount > quota[name]:
                    short = bucket.get(name, Decimal(0)) + amount - quota[name]
                    why.append(
                        f"insufficient unused quota for {name} in flavor {FLAVOR}, "
                        f"{_fmt(short)} more needed"
                    )
            if why:
                pod_set = w["spec"]["podSets"][0]["name"]
                self._pending(w, f"couldn't assign flavors to pod set {pod_set}: " + ", ".join(why))
                continue
            for name, amount in need.items():
                bucket[name] = bucket.get(name, Decimal(0)) + amount
            self._admit(w, f"cq-{queue}")

    def _pending(self, workload: dict[str, Any], message: str) -> None:
        current = find_condition(workload.get("status") or {}, "QuotaReserved") or {}
        if current.get("message") != message:
            self._set_condition(workload, "QuotaReserved", "False", "Pending", message)

    def _admit(self, workload: dict[str, Any], cluster_queue: str) -> None:
        status = copy.deepcopy(workload.get("status") or {})
        quota = self.settings.queues[workload["spec"]["queueName"]]
        assignments = []
        for ps in workload["spec"]["podSets"]:
            usage = self._usage({"spec": {"podSets": [ps]}}, quota)
            assignments.append(
                {
                    "name": ps["name"],
                    "count": ps["count"],
                    "flavors": dict.fromkeys(usage, FLAVOR),
                    "resourceUsage": {r: _fmt(v) for r, v in usage.items()},
                }
            )
        status["admission"] = {"clusterQueue": cluster_queue, "podSetAssignments": assignments}
        now = now_rfc3339()
        status["conditions"] = [
            c
            for c in status.get("conditions") or []
            if c.get("type") not in ("QuotaReserved", "Admitted")
        ] + [
            {
                "type": "QuotaReserved",
                "status": "True",
                "reason": "QuotaReserved",
                "message": f"Quota reserved in ClusterQueue {cluster_queue}",
                "lastTransitionTime": now,
            },
            {
                "type": "Admitted",
                "status": "True",
                "reason": "Admitted",
                "message": "The workload is admitted",
                "lastTransitionTime": now,
            },
        ]
        meta = workload["metadata"]
        self.fake.set_status(WORKLOADS, meta["name"], status, namespace=meta["namespace"])


def _kueue_patch(tj: dict[str, Any]) -> dict[str, Any] | None:
    """getKueueRuntimePatch L324-L331: the runtimePatches entry of manager
    `kueue.x-k8s.io/manager` (the live object's, to be modified in place)."""
    for patch in (tj.get("spec") or {}).get("runtimePatches") or []:
        if patch.get("manager") == RUNTIME_PATCH_MANAGER:
            out: dict[str, Any] = patch
            return out
    return None


def _get_args(key: Key) -> tuple[str, str, str]:
    """(plural, name, namespace): FakeK8s.get_object's argument order for a Key."""
    return key[0], key[2], key[1]
