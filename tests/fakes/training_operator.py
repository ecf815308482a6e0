"""The simulated cluster's Training Operator: kubeflow.org/v1 PyTorchJob.

A FAKE, for tests only. It follows kubeflow/training-operator release-1.9 (the last with the
v1 API), and cites the code each behaviour comes from:

- defaults (pkg/apis/kubeflow.org/v1/pytorch_defaults.go): replicas 1, restartPolicy
  OnFailure, nprocPerNode "auto", cleanPodPolicy None; the `pytorch` container gets the port
  `pytorchjob-port` 23456 when it has none.
- pods (pkg/controller.v1/common/pod.go createNewPod): one per replica, named
  `<job>-<type>-<index>` (type lowercased), labels `training.kubeflow.org/operator-name:
  pytorchjob-controller`, `training.kubeflow.org/job-name`, `.../replica-type` (lowercase),
  `.../replica-index`, and `training.kubeflow.org/job-role: master` on the master; a
  controller ownerReference to the job; the pod restartPolicy is the replica's, except
  ExitCode which becomes Never (core.SetRestartPolicy).
- env (pkg/controller.v1/pytorch/envvar.go setPodEnv, master.go), appended to every
  container: PYTHONUNBUFFERED=0, MASTER_PORT, PET_MASTER_PORT, MASTER_ADDR,
  PET_MASTER_ADDR, WORLD_SIZE (replicas x nprocPerNode, "auto" counting 1), RANK and
  PET_NODE_RANK (master 0, worker i is i+1), PET_NPROC_PER_NODE, PET_NNODES (replicas).
  Sim difference: MASTER_ADDR is 127.0.0.1, not the master's Service name `<job>-master-0`,
  and the port is a free port per job, not the container's pytorchjob-port (23456), so jobs
  can run side by side on one machine. elasticPolicy is not simulated.
- status (pytorchjob_controller.go UpdateJobStatus, common/job.go ReconcileJobs,
  pkg/util/status.go): conditions Created (`PyTorchJobCreated`, "PyTorchJob x is created."),
  Running (`PyTorchJobRunning`, "PyTorchJob x is running." while the master runs),
  Succeeded (`PyTorchJobSucceeded`, "PyTorchJob x is successfully completed." when the
  master succeeds; Running turns False), Restarting (`PyTorchJobRestarting`), Failed
  (`PyTorchJobFailed`) with the upstream message for the cause:
    restartPolicy Never, a failed replica:
      `PyTorchJob x is failed because 1 Master replica(s) failed.`
    ExitCode, exit 1-127 (permanent): `job "x" is failing because "Master" replica(s) failed.`
    ExitCode, exit 128-255 (retryable), OnFailure, Always: the pod is deleted and recreated
      (Restarting: `job x is restarting because Master replica(s) failed.`) until
      runPolicy.backoffLimit: `Job x has failed because it has reached the specified backoff limit`
    runPolicy.activeDeadlineSeconds: `Job x has failed because it was active longer than
      specified deadline` (reason PyTorchJobFailed: v1 has no DeadlineExceeded reason), and
      every pod is deleted;
  replicaStatuses {Master: {active, succeeded, failed, selector}}, startTime, completionTime.
- after the job finishes: a succeeded job counts its still active replicas as succeeded;
  cleanPodPolicy None keeps the pods, Running deletes the running and
  pending ones, All deletes all; runPolicy.ttlSecondsAfterFinished deletes the job that
  long after completionTime (CleanupJob).

Backoff counting: upstream counts a retryable ExitCode failure through the work queue's
requeue count and OnFailure/Always restarts through containers' restartCount; the sim counts
the pods it recreated plus restartCounts, and fails the job on the failure that would exceed
backoffLimit (so a job runs at most backoffLimit + 1 times).
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


def update_condition(
    status: dict[str, Any], ctype: str, cstatus: str, reason: str, message: str
) -> None:
    """pkg/util/status.go UpdateJobConditions/setCondition/filterOutCondition."""
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
    """The `pytorch` container's exit code; 0xbeef when it has none (upstream's magic)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated")
        if cs.get("name") == CONTAINER and terminated:
            return int(terminated.get("exitCode", 0))
    return 0xBEEF


class TrainingOperator(Controller):
    name = "training-operator"

    def __init__(self, sim: Any) -> None:
        super().__init__(sim)
        self._ports: dict[str, int] = {}  # job uid -> its master port
        self._retries: dict[str, int] = {}  # job uid -> pods recreated

    def keys_for(self, event: Event) -> Iterable[Key]:
        if event.plural == "pytorchjobs":
            return [] if event.type == "DELETED" else self.own_key(event, "pytorchjobs")
        if event.plural == "pods":
            return self.owner_key(event, KIND)
        return []

    def reconcile(self, key: Key) -> None:
        job = self.get(key)
        if job is None:
            return
        status = copy.deepcopy(job.get("status") or {})
        before = copy.deepcopy(status)
        name = job["metadata"]["name"]
        if find_condition(status, "Created") is None:  # onOwnerCreateFunc
            update_condition(
                status, "Created", "True", f"{KIND}Created", f"PyTorchJob {name} is created."
            )
        pods = self.owned("pods", job)
        if is_true(status, "Succeeded") or is_true(status, "Failed"):
            if is_true(status, "Succeeded"):  # common/job.go: active replicas count as done
                for rs in (status.get("replicaStatuses") or {}).values():
                    if rs.get("active"):
                        rs["succeeded"] = rs.get("succeeded", 0) + rs.pop("active")
            self._write(key, status, before)
            self._finished(key, job, status, pods)
            return
        run_policy = (job.get("spec") or {}).get("runPolicy") or {}
        if not status.get("startTime"):
            status["startTime"] = now_rfc3339()
            if run_policy.get("activeDeadlineSeconds") is not None:
                self.requeue(key, float(run_policy["activeDeadlineSeconds"]))
        failure = self._past_limits(job, status, pods)
        if failure:
            status.setdefault("completionTime", now_rfc3339())
            for pod in pods:  # DeletePodsAndServices: the job is not finished yet, so all
                self._delete_pod(pod)
            update_condition(status, "Failed", "True", f"{KIND}Failed", failure)
            self._write(key, status, before)
            self.requeue(key)
            return
        self._reconcile_pods(job, status, pods)
        self._update_job_status(job, status)
        if not status.get("completionTime") and (
            is_true(status, "Succeeded") or is_true(status, "Failed")
        ):
            status["completionTime"] = now_rfc3339()
        self._write(key, status, before)
        if is_true(status, "Succeeded") or is_true(status, "Failed"):
            self.requeue(key)

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
        name = job["metadata"]["name"]
        uid = job["metadata"]["uid"]
        run_policy = (job.get("spec") or {}).get("runPolicy") or {}
        limit = run_policy.get("backoffLimit")
        if limit is not None:
            specs = self._specs(job)
            restarts = sum(
                cs.get("restartCount", 0)
                for p in pods
                if (p.get("status") or {}).get("phase") == "Running"
                and specs.get(self._rtype(p), {}).get("restartPolicy") != "Never"
                for cs in (p.get("status") or {}).get("containerStatuses") or []
            )
            retryable = [p for p in pods if self._retryable_failure(p, specs)]
            new_failure = bool(retryable) and self._retries.get(uid, 0) + 1 > limit
            past = restarts > 0 if limit == 0 else restarts >= limit
            if new_failure or past:
                return f"Job {name} has failed because it has reached the specified backoff limit"
        deadline = run_policy.get("activeDeadlineSeconds")
        start = parse_time(status.get("startTime"))
        if deadline is not None and start is not None and time.time() - start >= deadline:
            return f"Job {name} has failed because it was active longer than specified deadline"
        return None

    def _rtype(self, pod: dict[str, Any]) -> str:
        return str(pod["metadata"].get("labels", {}).get(REPLICA_TYPE, "")).capitalize()

    def _retryable_failure(self, pod: dict[str, Any], specs: dict[str, dict[str, Any]]) -> bool:
        if (pod.get("status") or {}).get("phase") != "Failed":
            return False
        policy = specs.get(self._rtype(pod), {}).get("restartPolicy")
        return policy in ("OnFailure", "Always") or (policy == "ExitCode" and exit_code(pod) >= 128)

    def _reconcile_pods(
        self, job: dict[str, Any], status: dict[str, Any], pods: list[dict[str, Any]]
    ) -> None:
        """common/pod.go ReconcilePods: create what is missing, restart what may be."""
        name, uid = job["metadata"]["name"], job["metadata"]["uid"]
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
                    if self._retryable_failure(pod, specs):
                        self._delete_pod(pod)
                        self._retries[uid] = self._retries.get(uid, 0) + 1
                        update_condition(
                            status,
                            "Restarting",
                            "True",
                            f"{KIND}Restarting",
                            f"job {name} is restarting because {rtype} replica(s) failed.",
                        )
                    elif spec["restartPolicy"] == "ExitCode":
                        update_condition(
                            status,
                            "Failed",
                            "True",
                            f"{KIND}Failed",
                            f'job "{name}" is failing because "{rtype}" replica(s) failed.',
                        )
                key = {"Running": "active", "Succeeded": "succeeded", "Failed": "failed"}
                if phase in key:
                    counts[key[phase]] += 1
            selector = f"{JOB_NAME}={name},{OPERATOR_NAME}={OPERATOR},{REPLICA_TYPE}={rt}"
            replica_statuses[rtype] = {k: v for k, v in counts.items() if v} | {
                "selector": selector
            }
        status["replicaStatuses"] = replica_statuses

    def _update_job_status(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        """pytorchjob_controller.go UpdateJobStatus."""
        name = job["metadata"]["name"]
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
                        update_condition(
                            status,
                            "Succeeded",
                            "True",
                            f"{KIND}Succeeded",
                            f"PyTorchJob {name} is successfully completed.",
                        )
                        return
            elif rtype == "Worker":
                if expected == 0:
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
        if rtype == "Master":
            labels[JOB_ROLE] = "master"
        pod_spec = template.get("spec") or {}
        pod_spec["restartPolicy"] = (
            "Never" if spec["restartPolicy"] == "ExitCode" else spec["restartPolicy"]
        )
        port = self._ports.setdefault(uid, free_port())
        total = sum(int(s["replicas"]) for s in specs.values())
        nproc = str((job.get("spec") or {}).get("nprocPerNode") or "auto")
        int(nproc) if nproc.isdigit() else 1  # getNprocPerNodeInt
        rank = index + 1 if rtype == "Worker" else index
        for container in pod_spec.get("containers") or []:
            if container.get("name") == CONTAINER and not any(
                p.get("name") == PORT_NAME for p in container.get("ports") or []
            ):
                container.setdefault("ports", []).append(
                    {"name": PORT_NAME, "containerPort": DEFAULT_PORT, "protocol": "TCP"}
                )
            env = container.setdefault("env", [])
            env.append({"name": "PYTHONUNBUFFERED", "value": "0"})
            if "Master" in specs:
                env += [
                    {"name": "MASTER_PORT", "value": str(port)},
                    {"name": "PET_MASTER_PORT", "value": str(port)},
                    {"name": "MASTER_ADDR", "value": "127.0.0.1"},
                    {"name": "PET_MASTER_ADDR", "value": "127.0.0.1"},
                    {
                        "name": "WORLD_SIZE",
                        "value": str(total * (int(nproc) if nproc.isdigit() else 1)),
                    },
                    {"name": "RANK", "value": str(rank)},
                    {"name": "PET_NPROC_PER_NODE", "value": nproc},
                    {"name": "PET_NODE_RANK", "value": str(rank)},
                ]
            env.append({"name": "PET_NNODES", "value": str(total)})
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

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        with contextlib.suppress(ApiError):
            self.fake.delete_object("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])

    def _finished(
        self, key: Key, job: dict[str, Any], status: dict[str, Any], pods: list[dict[str, Any]]
    ) -> None:
        run_policy = (job.get("spec") or {}).get("runPolicy") or {}
        clean = run_policy.get("cleanPodPolicy") or "None"
        for pod in pods:
            phase = (pod.get("status") or {}).get("phase")
            if clean == "All" or (clean == "Running" and phase in ("Running", "Pending")):
                self._delete_pod(pod)
        ttl = run_policy.get("ttlSecondsAfterFinished")
        done = parse_time(status.get("completionTime"))
        if ttl is None or done is None:
            return
        remaining = done + float(ttl) - time.time()
        if remaining > 0:
            self.requeue(key, remaining)
            return
        with contextlib.suppress(ApiError):
            self.fake.delete_object("pytorchjobs", key[2], key[1])
        self._ports.pop(job["metadata"]["uid"], None)

    def _write(self, key: Key, status: dict[str, Any], before: dict[str, Any]) -> None:
        if status != before:
            with contextlib.suppress(ApiError):
                self.fake.set_status(key[0], key[2], status, namespace=key[1])
