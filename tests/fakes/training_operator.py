"""The simulated cluster's Training Operator: kubeflow.org/v1 PyTorchJob.

A FAKE, for tests only. It follows kubeflow/training-operator at tag v1.9.0 (release-1.9, the
last with the v1 API; the branch's later commits do not touch these files), and cites the
code each behaviour comes from (paths at that tag; `common/` is pkg/controller.v1/common,
`pytorch/` is pkg/controller.v1/pytorch). tests/fakes/UPSTREAM.md has one row per rule.

- defaults (pkg/apis/kubeflow.org/v1/pytorch_defaults.go SetDefaults_PyTorchJob L77-96):
  replicas 1, restartPolicy OnFailure, nprocPerNode "auto", cleanPodPolicy None; the
  `pytorch` container gets the port `pytorchjob-port` 23456 when it has none.
- pods (common/pod.go createNewPod L383-474): one per replica, named `<job>-<type>-<index>`
  (type lowercased), labels `training.kubeflow.org/operator-name: pytorchjob-controller`,
  `training.kubeflow.org/job-name`, `.../replica-type` (lowercase), `.../replica-index`,
  and `training.kubeflow.org/job-role: master` on the master; a controller ownerReference to
  the job; the pod restartPolicy is the replica's, except ExitCode which becomes Never
  (pkg/core/pod.go SetRestartPolicy L81-88).
- env (pytorch/envvar.go setPodEnv L43-127, pytorch/master.go L33-62), appended to every
  container (not to init containers): PYTHONUNBUFFERED=1; with a Master: MASTER_PORT,
  PET_MASTER_PORT, MASTER_ADDR, PET_MASTER_ADDR, WORLD_SIZE (replicas x nprocPerNode, "auto"
  counting 1), RANK and PET_NODE_RANK (master 0, worker i is i+1); PET_NPROC_PER_NODE;
  PET_NNODES (replicas). Sim difference: MASTER_ADDR is 127.0.0.1, not the master's Service
  name `<job>-master-0`, and the port is a free port per job, not the container's
  pytorchjob-port (23456), so jobs can run side by side on one machine.
- elasticPolicy (pytorch/elastic.go Generate L68-122, pytorch_defaults.go setElasticPolicy
  L38-55 and setDefaultNprocPerNode L68-74): min and max replicas default from each other,
  or both from the Worker replicas; the env has, instead of PET_NNODES=<replicas>,
  PET_RDZV_ENDPOINT (rdzvHost or `<job>-worker-0`, rdzvPort or the Worker's pytorchjob-port),
  PET_RDZV_BACKEND (rdzvBackend or c10d), PET_NNODES `min:max`, then PET_MAX_RESTARTS,
  PET_NPROC_PER_NODE (the deprecated elasticPolicy.nProcPerNode, which also keeps
  spec.nprocPerNode from defaulting to auto), PET_RDZV_ID, PET_RDZV_CONF (`k=v,k=v`) and
  PET_STANDALONE when set. Sim difference: the default endpoint is 127.0.0.1 on a free port
  per job (as MASTER_ADDR above); every pod's agent then takes itself for the endpoint's host
  (a loopback address, torch's _matches_machine_hostname), and the first to bind the port
  hosts the c10d TCPStore, where on a cluster only `<job>-worker-0` matches it. torchrun's
  elastic agent is the real one, in the pods' processes. Metrics (an HPA) are not simulated.
- the master role (pytorchjob_controller.go IsMasterRole L499-506): the Master, or in a job
  without one Worker 0, gets `training.kubeflow.org/job-role: master`.
- the `init-pytorch` init container (pytorch/initcontainer.go L35-46, setInitContainer
  L105-136; the image and tries from pkg/config/config.go L28, L33): appended to every
  Worker pod of a job with a Master. It waits for the master's Service name to resolve;
  the sim's kubelet does not run init containers, but the pod spec carries it, so whatever
  reads pod specs (QoS, Pod Security) sees what a cluster would.
- runPolicy.suspend (common/job.go ReconcileJobs L146-173): while suspended, every pod is
  deleted, replica `active` counts drop to 0, Running turns False and Suspended True (both
  reason `PyTorchJobSuspended`, "PyTorchJob x is suspended."), and no startTime is set; on
  resume, Suspended turns False (`PyTorchJobResumed`, "PyTorchJob x is resumed.") and
  startTime is reset to now, so activeDeadlineSeconds counts from the resume.
- status (pytorch/pytorchjob_controller.go UpdateJobStatus L343-447, common/job.go
  ReconcileJobs L78-364, pkg/util/status.go): conditions Created (`PyTorchJobCreated`,
  "PyTorchJob x is created."), Running (`PyTorchJobRunning`, "PyTorchJob x is running."
  while the master runs), Succeeded (`PyTorchJobSucceeded`, "PyTorchJob x is successfully
  completed." when the master succeeds; Running turns False), Restarting
  (`PyTorchJobRestarting`), Failed (`PyTorchJobFailed`) with the upstream message:
    restartPolicy Never, a failed replica:
      `PyTorchJob x is failed because 1 Master replica(s) failed.`
    ExitCode, exit 1-127 (permanent): `job "x" is failing because "Master" replica(s) failed.`
      (common/pod.go L367-373; no completionTime is set on this path)
    ExitCode, exit 128-255 (retryable), OnFailure, Always: the pod is deleted and recreated
      (common/pod.go L350-366, Restarting: `job x is restarting because Master replica(s)
      failed.`)
    the backoff limit: `Job x has failed because it has reached the specified backoff limit`
    runPolicy.activeDeadlineSeconds: `Job x has failed because it was active longer than
      specified deadline` (reason PyTorchJobFailed: v1 has no DeadlineExceeded reason), and
      every pod is deleted;
  replicaStatuses {Master: {active, succeeded, failed, selector}}, startTime, completionTime.
- after the job finishes: a succeeded job counts its still active replicas as succeeded;
  cleanPodPolicy None keeps the pods, Running deletes the running and pending ones, All
  deletes all (common/job.go DeletePodsAndServices L43-69); runPolicy.ttlSecondsAfterFinished
  deletes the job that long after completionTime (CleanupJob L420-453), and never a job
  without one (L428-429: "job completion time is nil, cannot cleanup"), which is every job
  failed by a permanent ExitCode exit.

Backoff and deadline, as release-1.9 does them (and the reason retries are unbounded there):

- The operator's work queue is `util.FakeWorkQueue` (pytorchjob_controller.go L82), whose
  NumRequeues is always 0 and whose AddAfter does nothing (pkg/common/util/fake_workqueue.go
  L47, L56). So ReconcileJobs' "new failure" test (common/job.go L192-198) fails a job only
  with backoffLimit 0, and PastBackoffLimit (pkg/core/job.go L95-133) sums the restartCount
  of the containers of *Running* pods: under ExitCode the operator recreates a failed pod
  (restartPolicy Never, so its restartCount stays 0), and backoffLimit >= 1 is never
  reached. A retryable exit loops until activeDeadlineSeconds (kubeflow/trainer#2045).
  OnFailure/Always count their in-place restarts as upstream does.
- activeDeadlineSeconds is checked only when the job is reconciled: the requeue at the
  deadline (pytorchjob_controller.go L365) goes to the FakeWorkQueue and is dropped, and the
  controller's Result requeues only for the TTL (L169-175, pkg/common/util/util.go L66-86).
  A quiet job runs past its deadline until an event about it or its pods arrives
  (kubeflow/trainer#3358); the sim, too, has no timer for it.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterable
from typing import Any

from .fake_k8s import ApiError, Event, owner_reference
from .sim_base import (
    Controller,
    Key,
    find_condition,
    free_port,
    is_true,
    new_condition,
    now_rfc3339,
    parse_time,
)

OPERATOR = "pytorchjob-controller"
JOB_NAME = "training.kubeflow.org/job-name"
OPERATOR_NAME = "training.kubeflow.org/operator-name"
REPLICA_TYPE = "training.kubeflow.org/replica-type"
REPLICA_INDEX = "training.kubeflow.org/replica-index"
JOB_ROLE = "training.kubeflow.org/job-role"
CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 23456
KIND = "PyTorchJob"
# pkg/config/config.go L28, L33: --pytorch-init-container-image / -max-tries defaults.
INIT_CONTAINER_IMAGE = "alpine:3.10"
INIT_CONTAINER_MAX_TRIES = 100
# pkg/util/train/train_util.go IsRetryableExitCode L24-26.
RETRYABLE_EXIT = 128
# common/pod.go L340: the exit code of a pod whose container has no terminated state.
NO_EXIT_CODE = 0xBEEF
BACKOFF_POLICIES = ("OnFailure", "Always", "ExitCode")  # pkg/core/job.go L103


def update_condition(
    status: dict[str, Any], ctype: str, cstatus: str, reason: str, message: str
) -> None:
    """pkg/util/status.go UpdateJobConditions/setCondition/filterOutCondition (L59-148)."""
    if is_true(status, "Failed"):
        return
    new = new_condition(status, ctype, cstatus, reason, message)
    if new is None:
        return
    kept = []
    for c in status.get("conditions") or []:
        if {ctype, c.get("type")} == {"Restarting", "Running"} or c.get("type") == ctype:
            continue
        if ctype in ("Failed", "Succeeded") and c.get("type") == "Running":
            c = {**c, "status": "False"}
        kept.append(c)
    status["conditions"] = [*kept, new]


def exit_code(pod: dict[str, Any]) -> int:
    """The `pytorch` container's exit code; 0xbeef when it has none (common/pod.go L340-348)."""
    code = NO_EXIT_CODE
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated")
        if cs.get("name") == CONTAINER and terminated:
            code = int(terminated.get("exitCode", 0))
    return code


def elastic_policy(job: dict[str, Any], specs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """spec.elasticPolicy with the defaults of setElasticPolicy (pytorch_defaults.go L38-55):
    min and max from each other, or both from the Worker replicas; None without one."""
    policy = (job.get("spec") or {}).get("elasticPolicy")
    if policy is None:
        return None
    policy = dict(policy)
    low, high = policy.get("minReplicas"), policy.get("maxReplicas")
    if low is None and high is None:
        low = high = int((specs.get("Worker") or {}).get("replicas", 1))
    policy["minReplicas"] = low if low is not None else high
    policy["maxReplicas"] = high if high is not None else low
    return policy


def init_container(job_name: str) -> dict[str, Any]:
    """pytorch/initcontainer.go initContainerTemplate (L35-46) with the default image and
    tries, for MasterAddr `<job>-master-0` (replicaName, envvar.go L150-153)."""
    master = f"{job_name}-master-0".replace("/", "-")
    script = (
        f"err=1;for i in $(seq {INIT_CONTAINER_MAX_TRIES}); do if nslookup {master}; "
        "then err=0 && break; fi;echo waiting for master; sleep 2; done; exit $err"
    )
    return {
        "name": "init-pytorch",
        "image": INIT_CONTAINER_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "resources": {
            "limits": {"cpu": "100m", "memory": "20Mi"},
            "requests": {"cpu": "50m", "memory": "10Mi"},
        },
        "command": ["sh", "-c", script],
    }


class TrainingOperator(Controller):
    name = "training-operator"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._ports: dict[str, int] = {}  # job uid -> its master port
        self._rdzv_ports: dict[str, int] = {}  # job uid -> its elastic rendezvous port

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.plural == "pytorchjobs":
            return [] if event.type == "DELETED" else self.own_key(event, "pytorchjobs")
        if event.plural == "pods":
            return self.owner_key(event, KIND)
        return []

    def reconcile(self, key: Key) -> None:
        """common/job.go ReconcileJobs, in its order: finished, suspended, resumed, limits,
        pods, status."""
        job = self.get(key)
        if job is None:
            return
        status = copy.deepcopy(job.get("status") or {})
        before = copy.deepcopy(status)
        name = job["metadata"]["name"]
        if find_condition(status, "Created") is None:  # onOwnerCreateFunc L517-527
            update_condition(
                status, "Created", "True", f"{KIND}Created", f"PyTorchJob {name} is created."
            )
        pods = self.owned("pods", job)
        run_policy = (job.get("spec") or {}).get("runPolicy") or {}
        if is_true(status, "Succeeded") or is_true(status, "Failed"):
            if is_true(status, "Succeeded"):  # common/job.go L131-136
                for rs in (status.get("replicaStatuses") or {}).values():
                    if rs.get("active"):
                        rs["succeeded"] = rs.get("succeeded", 0) + rs.pop("active")
            self._write(key, status, before)
            self._finished(key, job, status, pods)
            return
        if run_policy.get("suspend"):  # common/job.go L146-166
            for pod in pods:  # DeletePodsAndServices: not finished, so every pod
                self._delete_pod(pod)
            for rs in (status.get("replicaStatuses") or {}).values():
                rs.pop("active", None)
            msg = f"PyTorchJob {name} is suspended."
            if is_true(status, "Running"):
                update_condition(status, "Running", "False", f"{KIND}Suspended", msg)
            if not is_true(status, "Suspended"):
                update_condition(status, "Suspended", "True", f"{KIND}Suspended", msg)
            self._write(key, status, before)
            return
        if is_true(status, "Suspended"):  # common/job.go L167-173
            msg = f"PyTorchJob {name} is resumed."
            update_condition(status, "Suspended", "False", f"{KIND}Resumed", msg)
            status["startTime"] = now_rfc3339()
        failure = self._past_limits(job, status, pods)
        if failure:  # common/job.go L216-247
            status.setdefault("completionTime", now_rfc3339())
            for pod in pods:  # DeletePodsAndServices: the job is not finished yet, so all
                self._delete_pod(pod)
            update_condition(status, "Failed", "True", f"{KIND}Failed", failure)
            self._write(key, status, before)
            self.requeue(key)
            return
        self._reconcile_pods(job, status, pods)
        self._update_job_status(job, status)
        self._write(key, status, before)
        if is_true(status, "Succeeded") or is_true(status, "Failed"):
            self.requeue(key)  # the status write's own event, as upstream

    # ------------------------------------------------------------ pods

    def _specs(self, job: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Replica specs with defaults applied, Master first."""
        specs = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        out = {}
        for rtype in sorted(specs, key=lambda t: t != "Master"):
            spec = copy.deepcopy(specs[rtype])
            spec.setdefault("replicas", 1)
            spec.setdefault("restartPolicy", "OnFailure")
            out[rtype] = spec
        return out

    def _past_limits(
        self, job: dict[str, Any], status: dict[str, Any], pods: list[dict[str, Any]]
    ) -> str | None:
        """common/job.go L175-214 with pkg/core/job.go PastBackoffLimit/PastActiveDeadline."""
        name = job["metadata"]["name"]
        run_policy = (job.get("spec") or {}).get("runPolicy") or {}
        limit = run_policy.get("backoffLimit")
        if limit is not None:
            specs = self._specs(job)
            previous_retry = 0  # FakeWorkQueue.NumRequeues (fake_workqueue.go L56)
            phases = [(p.get("status") or {}).get("phase") for p in pods]
            active = sum(
                1
                for p, phase in zip(pods, phases, strict=True)
                if phase not in ("Succeeded", "Failed")
                and not p["metadata"].get("deletionTimestamp")
            )
            failed = phases.count("Failed")
            total = sum(int(s["replicas"]) for s in specs.values())
            previously_failed = sum(
                int(rs.get("failed", 0)) for rs in (status.get("replicaStatuses") or {}).values()
            )
            exceeds = failed > previously_failed and active != total and previous_retry + 1 > limit
            restarts = sum(
                int(cs.get("restartCount", 0))
                for p in pods
                if (p.get("status") or {}).get("phase") == "Running"
                and specs.get(self._rtype(p), {}).get("restartPolicy") in BACKOFF_POLICIES
                for cs in [
                    *((p.get("status") or {}).get("initContainerStatuses") or []),
                    *((p.get("status") or {}).get("containerStatuses") or []),
                ]
            )
            past = restarts > 0 if limit == 0 else restarts >= limit
            if exceeds or past:
                return f"Job {name} has failed because it has reached the specified backoff limit"
        deadline = run_policy.get("activeDeadlineSeconds")
        start = parse_time(status.get("startTime"))
        if deadline is not None and start is not None and time.time() - start >= deadline:
            return f"Job {name} has failed because it was active longer than specified deadline"
        return None

    def _rtype(self, pod: dict[str, Any]) -> str:
        return str(pod["metadata"].get("labels", {}).get(REPLICA_TYPE, "")).capitalize()

    def _reconcile_pods(
        self, job: dict[str, Any], status: dict[str, Any], pods: list[dict[str, Any]]
    ) -> None:
        """common/pod.go ReconcilePods (L269-380): create what is missing, restart what may
        be, fail the job on a permanent ExitCode exit."""
        name = job["metadata"]["name"]
        specs = self._specs(job)
        replica_statuses: dict[str, dict[str, Any]] = {}
        for rtype, spec in specs.items():
            rt = rtype.lower()
            counts = {"active": 0, "succeeded": 0, "failed": 0}
            for index in range(int(spec["replicas"])):
                pod = next(
                    (
                        p
                        for p in pods
                        if p["metadata"].get("labels", {}).get(REPLICA_TYPE) == rt
                        and p["metadata"]["labels"].get(REPLICA_INDEX) == str(index)
                    ),
                    None,
                )
                if pod is None:
                    self._create_pod(job, rtype, index, spec, specs)
                    continue
                phase = (pod.get("status") or {}).get("phase")
                if phase == "Failed":
                    policy = spec["restartPolicy"]
                    code = exit_code(pod)
                    if (policy == "ExitCode" and code >= RETRYABLE_EXIT) or policy in (
                        "OnFailure",
                        "Always",
                    ):
                        self._delete_pod(pod)
                        update_condition(
                            status,
                            "Restarting",
                            "True",
                            f"{KIND}Restarting",
                            f"job {name} is restarting because {rtype} replica(s) failed.",
                        )
                    elif policy == "ExitCode":
                        update_condition(
                            status,
                            "Failed",
                            "True",
                            f"{KIND}Failed",
                            f'job "{name}" is failing because "{rtype}" replica(s) failed.',
                        )
                key = {"Running": "active", "Succeeded": "succeeded", "Failed": "failed"}
                if phase == "Running" and pod["metadata"].get("deletionTimestamp"):
                    counts["failed"] += 1  # pkg/core/status.go L36-44
                elif phase in key:
                    counts[key[phase]] += 1
            selector = f"{JOB_NAME}={name},{OPERATOR_NAME}={OPERATOR},{REPLICA_TYPE}={rt}"
            replica_statuses[rtype] = {k: v for k, v in counts.items() if v} | {
                "selector": selector
            }
        status["replicaStatuses"] = replica_statuses

    def _update_job_status(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        """pytorchjob_controller.go UpdateJobStatus (L343-447)."""
        name = job["metadata"]["name"]
        if not status.get("startTime"):  # L359-367 (its AddAfter is dropped: no timer)
            status["startTime"] = now_rfc3339()
        specs = self._specs(job)
        for rtype, spec in specs.items():
            rs = status["replicaStatuses"].get(rtype, {})
            succeeded, running, failed = (rs.get(k, 0) for k in ("succeeded", "active", "failed"))
            expected = int(spec["replicas"]) - succeeded
            if "Master" in specs:
                if rtype == "Master":
                    if running > 0:
                        update_condition(
                            status,
                            "Running",
                            "True",
                            f"{KIND}Running",
                            f"PyTorchJob {name} is running.",
                        )
                    if expected == 0:
                        status.setdefault("completionTime", now_rfc3339())
                        update_condition(
                            status,
                            "Succeeded",
                            "True",
                            f"{KIND}Succeeded",
                            f"PyTorchJob {name} is successfully completed.",
                        )
                        return
            elif rtype == "Worker":
                elastic = (job.get("spec") or {}).get("elasticPolicy") is not None
                if expected == 0 or (elastic and succeeded > 0):  # L404-418
                    status.setdefault("completionTime", now_rfc3339())
                    update_condition(
                        status,
                        "Succeeded",
                        "True",
                        f"{KIND}Succeeded",
                        f"PyTorchJob {job['metadata']['namespace']}/{name} successfully completed.",
                    )
                elif running > 0:
                    update_condition(
                        status,
                        "Running",
                        "True",
                        f"{KIND}Running",
                        f"PyTorchJob {job['metadata']['namespace']}/{name} is running.",
                    )
            if failed > 0 and int(spec["replicas"]) > succeeded + running:
                if spec["restartPolicy"] != "Never":
                    update_condition(
                        status,
                        "Restarting",
                        "True",
                        f"{KIND}Restarting",
                        f"PyTorchJob {name} is restarting because {failed} {rtype} "
                        "replica(s) failed.",
                    )
                else:
                    status.setdefault("completionTime", now_rfc3339())
                    update_condition(
                        status,
                        "Failed",
                        "True",
                        f"{KIND}Failed",
                        f"PyTorchJob {name} is failed because {failed} {rtype} replica(s) failed.",
                    )

    def _create_pod(
        self,
        job: dict[str, Any],
        rtype: str,
        index: int,
        spec: dict[str, Any],
        specs: dict[str, dict[str, Any]],
    ) -> None:
        meta = job["metadata"]
        name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
        template = copy.deepcopy(spec.get("template") or {})
        tmeta = template.get("metadata") or {}
        labels = dict(tmeta.get("labels") or {})
        labels.update(
            {
                OPERATOR_NAME: OPERATOR,
                JOB_NAME: name.replace("/", "-"),
                REPLICA_TYPE: rtype.lower(),
                REPLICA_INDEX: str(index),
            }
        )
        if rtype == "Master" or ("Master" not in specs and index == 0):  # IsMasterRole
            labels[JOB_ROLE] = "master"
        pod_spec = template.get("spec") or {}
        pod_spec["restartPolicy"] = (
            "Never" if spec["restartPolicy"] == "ExitCode" else spec["restartPolicy"]
        )
        port = self._ports.setdefault(uid, free_port())
        total = sum(int(s["replicas"]) for s in specs.values())
        elastic = elastic_policy(job, specs)
        nproc: str | None = (job.get("spec") or {}).get("nprocPerNode")
        if nproc is None and (elastic is None or elastic.get("nProcPerNode") is None):
            nproc = "auto"  # setDefaultNprocPerNode (pytorch_defaults.go L68-74)
        per_node = int(nproc) if nproc and nproc.isdigit() else 1  # getNprocPerNodeInt
        rank = index + 1 if rtype == "Worker" else index
        for container in pod_spec.get("containers") or []:
            if container.get("name") == CONTAINER and not any(
                p.get("name") == PORT_NAME for p in container.get("ports") or []
            ):
                container.setdefault("ports", []).append(
                    {"name": PORT_NAME, "containerPort": DEFAULT_PORT, "protocol": "TCP"}
                )
            env = container.setdefault("env", [])
            env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
            if "Master" in specs:
                env += [
                    {"name": "MASTER_PORT", "value": str(port)},
                    {"name": "PET_MASTER_PORT", "value": str(port)},
                    {"name": "MASTER_ADDR", "value": "127.0.0.1"},
                    {"name": "PET_MASTER_ADDR", "value": "127.0.0.1"},
                    {"name": "WORLD_SIZE", "value": str(total * per_node)},
                    {"name": "RANK", "value": str(rank)},
                    {"name": "PET_NODE_RANK", "value": str(rank)},
                ]
            if nproc is not None:
                env.append({"name": "PET_NPROC_PER_NODE", "value": nproc})
            if elastic is not None:  # envvar.go L106-116
                env += self._elastic_env(job, elastic)
            else:
                env.append({"name": "PET_NNODES", "value": str(total)})
        if rtype == "Worker" and "Master" in specs:  # setInitContainer L116-134
            pod_spec["initContainers"] = [
                *(pod_spec.get("initContainers") or []),
                init_container(name),
            ]
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{name}-{rtype.lower()}-{index}",
                "labels": labels,
                "ownerReferences": [owner_reference(job)],
                **({"annotations": tmeta["annotations"]} if tmeta.get("annotations") else {}),
            },
            "spec": pod_spec,
        }
        try:
            self.fake.create_object("pods", pod, ns)
        except ApiError as e:
            if e.code != 409:  # 409: a pod of a previous round is still there
                self.sim.errors.append(f"{self.name}: creating pod {pod['metadata']['name']}: {e}")

    def _elastic_env(self, job: dict[str, Any], elastic: dict[str, Any]) -> list[dict[str, str]]:
        """pytorch/elastic.go ElasticEnvVarGenerator.Generate (L68-122), in its order."""
        uid = job["metadata"]["uid"]
        host = elastic.get("rdzvHost")
        port = elastic.get("rdzvPort")
        if host is None:  # `<job>-worker-0` (L149-150): here, loopback (see the docstring)
            host = "127.0.0.1"
        if port is None:  # the Worker's pytorchjob-port (L156-161): here, a free port
            port = self._rdzv_ports.setdefault(uid, free_port())
        env = [
            {"name": "PET_RDZV_ENDPOINT", "value": f"{host}:{port}"},
            {"name": "PET_RDZV_BACKEND", "value": str(elastic.get("rdzvBackend") or "c10d")},
            {
                "name": "PET_NNODES",
                "value": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
            },
        ]
        if elastic.get("maxRestarts") is not None:
            env.append({"name": "PET_MAX_RESTARTS", "value": str(elastic["maxRestarts"])})
        if elastic.get("nProcPerNode") is not None:
            env.append({"name": "PET_NPROC_PER_NODE", "value": str(elastic["nProcPerNode"])})
        if elastic.get("rdzvId") is not None:
            env.append({"name": "PET_RDZV_ID", "value": str(elastic["rdzvId"])})
        if elastic.get("rdzvConf") is not None:  # L171-184: k=v joined by commas
            conf = ",".join(f"{c.get('key', '')}={c.get('value', '')}" for c in elastic["rdzvConf"])
            env.append({"name": "PET_RDZV_CONF", "value": conf})
        if elastic.get("standalone"):
            env.append({"name": "PET_STANDALONE", "value": ""})
        return env

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):
            self.fake.delete_object("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])

    def _finished(
        self, key: Key, job: dict[str, Any], status: dict[str, Any], pods: list[dict[str, Any]]
    ) -> None:
        """common/job.go CleanUpResources: DeletePodsAndServices (L43-69) and CleanupJob
        (L420-453)."""
        run_policy = (job.get("spec") or {}).get("runPolicy") or {}
        clean = run_policy.get("cleanPodPolicy") or "None"
        for pod in pods:
            phase = (pod.get("status") or {}).get("phase")
            if clean == "All" or (clean == "Running" and phase in ("Running", "Pending")):
                self._delete_pod(pod)
        ttl = run_policy.get("ttlSecondsAfterFinished")
        if ttl is None or run_policy.get("suspend"):
            return
        done = parse_time(status.get("completionTime"))
        if done is None:  # "job completion time is nil, cannot cleanup": never deleted
            return
        remaining = done + float(ttl) - time.time()
        if remaining > 0:
            self.requeue(key, remaining)  # the Result's RequeueAfter (L169-175)
            return
        with contextlib.suppress(ApiError):
            self.fake.delete_object("pytorchjobs", key[2], key[1])
        self._ports.pop(job["metadata"]["uid"], None)
        self._rdzv_ports.pop(job["metadata"]["uid"], None)

    def _write(self, key: Key, status: dict[str, Any], before: dict[str, Any]) -> None:
        if status != before:
            with contextlib.suppress(ApiError):
                self.fake.set_status(key[0], key[2], status, namespace=key[1])
