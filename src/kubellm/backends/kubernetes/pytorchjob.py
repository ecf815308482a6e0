"""Run a TrainJob as a Training Operator v1 PyTorchJob and wait for it.

The pod runs the same entrypoint as every launcher, torchrun through
`python -m kubellm.train.agent -m kubellm.train ARGS` (or the
job's other `module`, e.g. preflight's fabric check); the operator sets the PET_* variables
(nnodes, node rank, master address/port) that torchrun reads, so nothing in the command is
cluster-specific. The Katib tuner reuses `build_pytorchjob` for its trials, so a trial is
exactly the job the trainer would run.

Example (a cluster with the Training Operator; the image holds kubellm):

    PyTorchJobTrainer().run(TrainJob(name="llm-train", image="ghcr.io/org/kubellm-trainer:1",
        train_args=["--config", "/workspace/run/train.json"], nnodes=2, nproc_per_node=8,
        workspace_pvc="kubellm-workspace", namespace="team-a"),
        cluster=ClusterSettings(gpus_per_node=8, fabric="rdma-ib"))
"""

from __future__ import annotations

import threading
from typing import Any

from kubeflow.training.constants import constants as to
from kubeflow.training.models import (
    KubeflowOrgV1ElasticPolicy,
    KubeflowOrgV1PyTorchJob,
    KubeflowOrgV1PyTorchJobSpec,
    KubeflowOrgV1ReplicaSpec,
    KubeflowOrgV1RunPolicy,
    KubeflowOrgV1SchedulingPolicy,
)
from kubernetes import client as k8s

from kubellm.backends.base import (
    JobFailed,
    JobResult,
    Trainer,
    TrainJob,
    dns_name,
    workspace_mount,
)
from kubellm.backends.kubernetes.client import (
    CustomResource,
    OnCluster,
    PodWatch,
    condition_is_true,
    container_security,
    failed_condition,
    pod_security,
    to_dict,
)
from kubellm.backends.kubernetes.podspec import (
    COMPONENT_LABEL,
    KUEUE_QUEUE_LABEL,
    MLFLOW_SECRET,
    MLFLOW_SECRET_ENV,
    ClusterSettings,
    secret_env,
)
from kubellm.train.metric_lines import parse_metrics

PYTORCHJOB = CustomResource(to.GROUP, to.VERSION, to.PYTORCHJOB_PLURAL, to.PYTORCHJOB_KIND)
# The operator finds the training container by this name (and injects PET_* into it only).
CONTAINER = to.PYTORCHJOB_CONTAINER
# The operator's label on the master's pods (Katib's metrics collector selects by it).
MASTER_ROLE_LABELS = {to.JOB_ROLE_LABEL: to.JOB_ROLE_MASTER}
SCRATCH = "/tmp"
# The rendezvous backend of an elastic job: the operator's default (elastic.go#L186-L196 at
# v1.9.0), set explicitly so the job says what it runs. c10d needs no etcd: the TCPStore is
# hosted by the torchrun agent of `<job>-worker-0` (the endpoint's host, elastic.go#L149-L150).
RDZV_BACKEND = "c10d"


def build_pytorchjob(
    job: TrainJob, cluster: ClusterSettings | None = None
) -> KubeflowOrgV1PyTorchJob:
    """The PyTorchJob for `job`: one Master, nnodes-1 Workers, one torchrun per pod, with the
    run's resources, placement and fabric (`cluster`)."""
    cluster = cluster or ClusterSettings()
    if not job.image:
        raise ValueError(f"TrainJob {job.name!r}: image is required to run on Kubernetes")
    if job.nnodes < 1 or job.nproc_per_node < 1:
        raise ValueError(
            f"TrainJob {job.name!r}: nnodes and nproc_per_node must be >= 1, "
            f"got {job.nnodes} and {job.nproc_per_node}"
        )
    template = job_pod_template(job, cluster)
    elastic = elastic_policy(job, cluster)
    if elastic is not None:
        # Elastic: Workers only. The operator's rendezvous endpoint is `<job>-worker-0` on
        # the Worker's pytorchjob-port (elastic.go#L146-L168 at v1.9.0), its webhook wants
        # a Worker spec (pytorchjob_webhook.go#L96-L101), and without a Master worker-0 is
        # the job's master role (pytorchjob_controller.go#L499-L506).
        replicas = {
            to.REPLICA_TYPE_WORKER: KubeflowOrgV1ReplicaSpec(
                replicas=job.nnodes, restart_policy="ExitCode", template=template
            )
        }
    else:
        replicas = {
            to.REPLICA_TYPE_MASTER: KubeflowOrgV1ReplicaSpec(
                replicas=1, restart_policy="ExitCode", template=template
            )
        }
        if job.nnodes > 1:
            replicas[to.REPLICA_TYPE_WORKER] = KubeflowOrgV1ReplicaSpec(
                replicas=job.nnodes - 1, restart_policy="ExitCode", template=template
            )
    scheduling = None
    if cluster.queue and cluster.gang_scheduler == "volcano":
        # The operator's gang scheduling (run with --gang-scheduler-name=volcano): a PodGroup
        # that starts all pods or none.
        scheduling = KubeflowOrgV1SchedulingPolicy(
            min_available=job.nnodes,
            queue=cluster.queue,
            priority_class=cluster.priority_class or None,
        )
    return KubeflowOrgV1PyTorchJob(
        api_version=PYTORCHJOB.api_version,
        kind=PYTORCHJOB.kind,
        metadata=k8s.V1ObjectMeta(
            name=dns_name(job.name), namespace=job.namespace, labels=cluster.labels()
        ),
        spec=KubeflowOrgV1PyTorchJobSpec(
            # spec.nprocPerNode, never elasticPolicy.nProcPerNode: deprecated, and the webhook
            # refuses the two together (pytorchjob_webhook.go#L102-L109 at v1.9.0)
            nproc_per_node=str(job.nproc_per_node),
            elastic_policy=elastic,
            pytorch_replica_specs=replicas,
            run_policy=KubeflowOrgV1RunPolicy(
                # Keep finished pods: their logs say what happened (deleted with the job).
                clean_pod_policy="None",
                # Retries of retryable exits (pre-emption, 128-255) under ExitCode. Operators
                # that honour it stop there; release-1.9 does not (RetryCount): the step
                # deletes the job after cluster.max_restarts.
                backoff_limit=3,
                # The operator stops the job at the step's own timeout, even when the step
                # itself is gone; the TTL deletes finished jobs and their pods.
                active_deadline_seconds=max(1, int(job.timeout_s)),
                ttl_seconds_after_finished=cluster.ttl_seconds,
                scheduling_policy=scheduling,
            ),
        ),
    )


def elastic_policy(job: TrainJob, cluster: ClusterSettings) -> KubeflowOrgV1ElasticPolicy | None:
    """The job's elasticPolicy, or None for a fixed-size job (`cluster.elastic_min_nodes` 0).

    The operator turns it into torchrun's settings in every pod (pkg/controller.v1/pytorch/
    elastic.go Generate, L68-L122 at v1.9.0): PET_RDZV_ENDPOINT `<job>-worker-0:23456`,
    PET_RDZV_BACKEND c10d, PET_NNODES `min:max`, PET_MAX_RESTARTS. So each pod's agent
    (kubellm.train.agent, torchrun) joins one c10d rendezvous; when a worker or a peer pod
    dies, the survivors' agents restart their workers (up to maxRestarts times), the
    operator recreates the dead pod under restartPolicy ExitCode (exit 128-255), and the
    group meets again and resumes from the last checkpoint. When worker-0 dies, the
    rendezvous store its agent hosted goes too: the other agents exit EXIT_RENDEZVOUS_LOST
    (201, retryable; kubellm.train.agent) and are recreated as well. minReplicas below
    nnodes lets the group go on with fewer nodes after torchrun's last-call wait: with
    another world size the data order, and so the weights, differ from a full run's.
    """
    if not cluster.elastic_min_nodes:
        return None
    if cluster.elastic_min_nodes > job.nnodes:
        raise ValueError(
            f"TrainJob {job.name!r}: elastic_min_nodes ({cluster.elastic_min_nodes}) is above "
            f"nnodes ({job.nnodes}), the elastic job's maxReplicas"
        )
    return KubeflowOrgV1ElasticPolicy(
        min_replicas=cluster.elastic_min_nodes,
        max_replicas=job.nnodes,
        max_restarts=cluster.elastic_max_restarts,
        rdzv_backend=RDZV_BACKEND,
    )


def pytorchjob_manifest(job: TrainJob, cluster: ClusterSettings | None = None) -> dict[str, Any]:
    """`build_pytorchjob` as the JSON body the API server receives."""
    return to_dict(build_pytorchjob(job, cluster))


def master_selector(name: str) -> str:
    """Labels the operator puts on the master pod of PyTorchJob `name`."""
    return f"{to.JOB_NAME_LABEL}={name},{to.REPLICA_TYPE_LABEL}={to.REPLICA_TYPE_MASTER.lower()}"


def master_role_selector(name: str) -> str:
    """Labels of the pod the operator gives the master role: the Master, or in a job without
    one (elastic) worker-0 (pytorchjob_controller.go IsMasterRole, L499-L506 at v1.9.0).
    Its log carries global rank 0's metric lines: c10d ranks nodes by their sorted host
    names, and `<job>-worker-0` sorts first."""
    return f"{to.JOB_NAME_LABEL}={name},{to.JOB_ROLE_LABEL}={to.JOB_ROLE_MASTER}"


def job_selector(name: str) -> str:
    """The label the operator puts on every pod of PyTorchJob `name`."""
    return f"{to.JOB_NAME_LABEL}={name}"


def pytorchjob_queued(obj: dict[str, Any]) -> str | None:
    """Why the PyTorchJob waits in a queue, or None once it is admitted.

    Kueue creates jobs suspended (`spec.runPolicy.suspend`) and unsuspends them on
    admission; the operator then reports Suspended=False (Resumed). Until both say so the
    job has no pods and its timeout must not run.
    """
    suspended = bool(((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend"))
    if not suspended and not condition_is_true(obj, "Suspended"):
        return None
    queue = ((obj.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    return f"suspended, queue {queue}" if queue else "suspended"


# Exit codes the operator retries under restartPolicy ExitCode: 128-255 (a signal, e.g. the
# agent's 200 for pre-emption, or 137 for OOM); kubeflow/training-operator
# pkg/util/train/train_util.go#L25 at v1.9.0.
RETRYABLE_EXIT = 128
# What the operator takes for the exit code of a pod whose container never terminated
# (pkg/controller.v1/common/pod.go#L340): retryable.
NO_EXIT_CODE = 0xBEEF


class RetryCount:
    """The retries of a PyTorchJob as its pods show them: the bound `max_restarts` that
    Training Operator release-1.9 does not keep.

    Under restartPolicy ExitCode the operator deletes a pod that exited 128-255 and creates
    it again with restartPolicy Never, and its backoffLimit sums only the in-place restarts
    (restartCount) of Running pods, which such pods never have: backoffLimit is never
    reached, and a retryable exit loops on every GPU of the job until activeDeadlineSeconds
    (kubeflow/training-operator pkg/core/job.go#L95-L133 and pkg/controller.v1/common/
    job.go#L192-L204 at v1.9.0, whose NumRequeues is always 0; kubeflow/trainer#2045).

    Retries are counted per replica (`master-0`, `worker-3`), once per pod: a pod that
    Failed with a retryable exit code (its `pytorch` container's, 128-255, or none at all,
    as the operator reads it) and was not being deleted; a pod replaced at its replica index
    without its end having been seen (a gap in the watch); and each in-place container
    restart (restartCount) of a pod that restarts. The job's count is its most-retried
    replica's, so a pre-emption that stops every pod of a 16-node job at once is one retry,
    not sixteen. A pod deleted by someone else (Kueue suspending the job, pre-emption, a
    node drain) is no failure of the job: neither it nor its successor is counted.
    """

    def __init__(self, name: str, max_restarts: int) -> None:
        self.name = name
        self.max_restarts = max_restarts
        self._lock = threading.Lock()
        self._retries: dict[tuple[str, str], int] = {}  # replica -> retries counted
        self._last: dict[tuple[str, str], tuple[str, str]] = {}  # replica -> (pod, what)
        self._current: dict[tuple[str, str], str] = {}  # replica -> uid of its newest pod
        self._ended: set[str] = set()  # uids whose end was seen (and counted if a retry)
        self._restarts: dict[str, int] = {}  # uid -> in-place restarts counted

    @property
    def count(self) -> int:
        """The retries of the most-retried replica."""
        return max(self._retries.values(), default=0)

    def watch(self) -> PodWatch:
        """What `KubeClient.run(pod_watch=...)` needs: every pod of the job, and this."""
        return PodWatch(job_selector(self.name), self.check)

    def check(self, event_type: str, pod: dict[str, Any]) -> str | None:
        """Count what `pod` shows; the reason to stop the job once `max_restarts` is passed."""
        meta = pod.get("metadata") or {}
        name = str(meta.get("name") or "")
        uid = str(meta.get("uid") or name)
        labels = meta.get("labels") or {}
        replica = (
            str(labels.get(to.REPLICA_TYPE_LABEL, name)),
            str(labels.get(to.REPLICA_INDEX_LABEL, "")),
        )
        status = pod.get("status") or {}
        with self._lock:
            if event_type == "DELETED":
                self._ended.add(uid)
                return None
            previous = self._current.get(replica)
            if previous is not None and previous != uid and previous not in self._ended:
                self._ended.add(previous)
                self._count(replica, name, "replaced without its end being seen")
            self._current[replica] = uid
            if (pod.get("spec") or {}).get("restartPolicy", "Always") != "Never":
                restarts = sum(
                    int(cs.get("restartCount") or 0) for cs in status.get("containerStatuses") or []
                )
                for _ in range(restarts - self._restarts.get(uid, 0)):
                    self._count(replica, name, "restarted in place")
                self._restarts[uid] = max(restarts, self._restarts.get(uid, 0))
            phase = status.get("phase")
            if phase in ("Succeeded", "Failed") and uid not in self._ended:
                self._ended.add(uid)
                code = _exit_code(pod)
                deleting = bool(meta.get("deletionTimestamp"))
                if phase == "Failed" and code >= RETRYABLE_EXIT and not deleting:
                    how = f"exit code {code}" if code != NO_EXIT_CODE else "no exit code"
                    reason = f", {status['reason']}" if status.get("reason") else ""
                    self._count(replica, name, how + reason)
            worst = max(self._retries, key=self._retries.__getitem__, default=None)
            if worst is None or self._retries[worst] <= self.max_restarts:
                return None
            pod_name, what = self._last[worst]
            return (
                f"pod {pod_name} failed {self._retries[worst]} times with retryable exits, "
                f"more than job_max_restarts={self.max_restarts} allows (the last time: "
                f"{what}); the Training Operator recreates such pods without end under "
                "restartPolicy ExitCode, whatever backoffLimit says"
            )

    def _count(self, replica: tuple[str, str], pod: str, what: str) -> None:
        self._retries[replica] = self._retries.get(replica, 0) + 1
        self._last[replica] = (pod, what)


def _exit_code(pod: dict[str, Any]) -> int:
    """The `pytorch` container's exit code as the operator reads it (0xbeef without one)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated")
        if cs.get("name") == CONTAINER and terminated:
            return int(terminated.get("exitCode") or 0)
    return NO_EXIT_CODE


def job_pod_template(job: TrainJob, cluster: ClusterSettings) -> k8s.V1PodTemplateSpec:
    """Every training pod: torchrun's agent as the `pytorch` container, the workspace volume,
    a memory-backed /dev/shm, and the run's resources, placement and fabric."""
    nccl = cluster.nccl()
    env = {"PYTHONUNBUFFERED": "1", **nccl, **job.env}  # metric lines reach the log promptly
    env_vars = [k8s.V1EnvVar(name=k, value=v) for k, v in env.items()]
    env_vars += secret_env(MLFLOW_SECRET, MLFLOW_SECRET_ENV)  # rank 0 logs to MLflow
    # The root filesystem is read-only: what torch, torchrun and Hugging Face write besides
    # the workspace (compile caches, rendezvous files, HOME) goes to an emptyDir at /tmp.
    env_vars.append(k8s.V1EnvVar(name="HOME", value=SCRATCH))
    mounts = [
        k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
        k8s.V1VolumeMount(name="scratch", mount_path=SCRATCH),
    ]
    # NCCL and DataLoader workers share memory through /dev/shm; the default is 64 MiB.
    volumes = [
        k8s.V1Volume(
            name="dshm",
            empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=cluster.shm_size),
        ),
        k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource()),
    ]
    if job.workspace_pvc:
        mounts.append(k8s.V1VolumeMount(name="workspace", mount_path=workspace_mount()))
        volumes.append(
            k8s.V1Volume(
                name="workspace",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                    claim_name=job.workspace_pvc
                ),
            )
        )
    security = container_security(read_only_root=True)
    if cluster.rdma:
        security.capabilities.add = ["IPC_LOCK"]  # RDMA pins memory (see podspec.py)
    container = k8s.V1Container(
        name=CONTAINER,
        image=job.image,
        # torchrun with exit codes for restartPolicy ExitCode (kubellm/train/agent.py).
        command=["python", "-m", "kubellm.train.agent"],
        args=["-m", job.module, *job.train_args],
        env=env_vars,
        resources=cluster.resources(),
        volume_mounts=mounts,
        security_context=security,
    )
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(
            labels={**cluster.labels(pod=True), **COMPONENT_LABEL},
            annotations=cluster.annotations(),
        ),
        spec=k8s.V1PodSpec(
            containers=[container],
            # Training never calls the Kubernetes API: no token in the pod.
            automount_service_account_token=False,
            volumes=volumes,
            security_context=pod_security(),
            node_selector=cluster.node_selector or None,
            tolerations=[_toleration(t) for t in cluster.tolerations] or None,
            priority_class_name=cluster.priority_class or None,
            # SIGTERM makes the trainer checkpoint before it exits (train/preempt.py): the
            # kubelet's SIGKILL must wait for that write, not the default 30 s.
            termination_grace_period_seconds=cluster.grace_seconds,
        ),
    )


def _toleration(raw: dict[str, Any]) -> k8s.V1Toleration:
    """A toleration from its API form (`tolerationSeconds` etc.); unknown keys are errors."""
    names = {v: k for k, v in k8s.V1Toleration.attribute_map.items()}
    unknown = sorted(set(raw) - names.keys())
    if unknown:
        raise ValueError(f"toleration {raw}: unknown field(s) {', '.join(unknown)}")
    return k8s.V1Toleration(**{names[k]: v for k, v in raw.items()})


class PyTorchJobTrainer(OnCluster, Trainer):
    """Trainer on a cluster: one PyTorchJob per run, metrics from the master pod's log."""

    def run(self, job: TrainJob) -> JobResult:
        """Create (or adopt, or replace) the job, stream the master's log while it runs,
        and return that log's metrics; JobFailed with the operator's reason otherwise.

        `job.timeout_s` counts from the job's admission (a job Kueue holds suspended waits
        up to QUEUE_TIMEOUT_S first), and the job is deleted with the reason once its pods
        have failed retryably more than `cluster.max_restarts` times (RetryCount)."""
        body = pytorchjob_manifest(job, self.cluster)
        name, ns = body["metadata"]["name"], job.namespace
        outcome = self.kube.run(
            PYTORCHJOB,
            ns,
            body,
            timeout_s=job.timeout_s,
            done=lambda obj: condition_is_true(obj, "Succeeded"),
            failure=failed_condition,
            follow_logs=master_role_selector(name)
            if self.cluster.elastic_min_nodes
            else master_selector(name),
            log_container=CONTAINER,
            queued=pytorchjob_queued,
            pod_watch=RetryCount(name, self.cluster.max_restarts).watch(),
        )
        if outcome.log_error is not None:  # the metrics are in this log; none misleads
            raise JobFailed(
                f"pytorchjob/{name} in {ns} succeeded but its master pod's log could not be "
                f"read ({outcome.log_error}); the pod must outlive the job (cleanPodPolicy None)"
            )
        return JobResult(name=name, logs=outcome.logs, metrics=parse_metrics(outcome.logs))

    def release(self, run_tag: str, namespace: str) -> list[str]:
        """Delete every PyTorchJob labelled with run `run_tag` (the exit handler's cleanup,
        Trainer.release): a job whose step was stopped runs on otherwise, holding its GPUs
        until its activeDeadlineSeconds (kubellm.backends.kubernetes.release)."""
        from kubellm.backends.kubernetes.release import delete_run_objects

        return delete_run_objects(self.kube, PYTORCHJOB, namespace, run_tag)
