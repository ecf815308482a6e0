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

from typing import Any

from kubeflow.training.constants import constants as to
from kubeflow.training.models import (
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
    KubeClient,
    condition_is_true,
    container_security,
    failed_condition,
    pod_security,
    to_dict,
)
from kubellm.backends.kubernetes.podspec import (
    COMPONENT_LABEL,
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
            nproc_per_node=str(job.nproc_per_node),
            pytorch_replica_specs=replicas,
            run_policy=KubeflowOrgV1RunPolicy(
                # Keep finished pods: their logs say what happened (deleted with the job).
                clean_pod_policy="None",
                # Retries of retryable exits (pre-emption, 128-255) under ExitCode.
                backoff_limit=3,
                # The operator stops the job at the step's own timeout, even when the step
                # itself is gone; the TTL deletes finished jobs and their pods.
                active_deadline_seconds=max(1, int(job.timeout_s)),
                ttl_seconds_after_finished=cluster.ttl_seconds,
                scheduling_policy=scheduling,
            ),
        ),
    )


def pytorchjob_manifest(job: TrainJob, cluster: ClusterSettings | None = None) -> dict[str, Any]:
    """`build_pytorchjob` as the JSON body the API server receives."""
    return to_dict(build_pytorchjob(job, cluster))


def master_selector(name: str) -> str:
    """Labels the operator puts on the master pod of PyTorchJob `name`."""
    return f"{to.JOB_NAME_LABEL}={name},{to.REPLICA_TYPE_LABEL}={to.REPLICA_TYPE_MASTER.lower()}"


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
            labels={**cluster.labels(), **COMPONENT_LABEL}, annotations=cluster.annotations()
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


class PyTorchJobTrainer(Trainer):
    """Trainer on a cluster: one PyTorchJob per run, metrics from the master pod's log."""

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        *,
        cluster: ClusterSettings | None = None,
        poll_interval_s: float = 10.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.kube = KubeClient(api_client, poll_interval_s, request_timeout_s)
        self.cluster = cluster or ClusterSettings()

    def run(self, job: TrainJob) -> JobResult:
        """Create (or adopt, or replace) the job, stream the master's log while it runs,
        and return that log's metrics; JobFailed with the operator's reason otherwise."""
        body = pytorchjob_manifest(job, self.cluster)
        name, ns = body["metadata"]["name"], job.namespace
        outcome = self.kube.run(
            PYTORCHJOB,
            ns,
            body,
            timeout_s=job.timeout_s,
            done=lambda obj: condition_is_true(obj, "Succeeded"),
            failure=failed_condition,
            follow_logs=master_selector(name),
            log_container=CONTAINER,
        )
        if outcome.log_error is not None:  # the metrics are in this log; none misleads
            raise JobFailed(
                f"pytorchjob/{name} in {ns} succeeded but its master pod's log could not be "
                f"read ({outcome.log_error}); the pod must outlive the job (cleanPodPolicy None)"
            )
        return JobResult(name=name, logs=outcome.logs, metrics=parse_metrics(outcome.logs))
