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
        gpus_per_node=8, workspace_pvc="kubellm-workspace", namespace="team-a"))
"""

from __future__ import annotations

from typing import Any

from kubeflow.training.constants import constants as to
from kubeflow.training.models import (
    KubeflowOrgV1PyTorchJob,
    KubeflowOrgV1PyTorchJobSpec,
    KubeflowOrgV1ReplicaSpec,
    KubeflowOrgV1RunPolicy,
)
from kubernetes import client as k8s

from kubellm.backends.base import WORKSPACE_MOUNT, JobFailed, JobResult, Trainer, TrainJob, dns_name
from kubellm.backends.kubernetes.client import (
    CustomResource,
    KubeClient,
    condition_is_true,
    container_security,
    failed_condition,
    pod_security,
    to_dict,
)
from kubellm.train.metric_lines import parse_metrics

PYTORCHJOB = CustomResource(to.GROUP, to.VERSION, to.PYTORCHJOB_PLURAL, to.PYTORCHJOB_KIND)
# The operator finds the training container by this name (and injects PET_* into it only).
CONTAINER = to.PYTORCHJOB_CONTAINER
# The operator's label on the master's pods (Katib's metrics collector selects by it).
MASTER_ROLE_LABELS = {to.JOB_ROLE_LABEL: to.JOB_ROLE_MASTER}
NCCL_ENV_CONFIG_MAP = "kubellm-nccl-env"
_LOG_TAIL_LINES = 20


def build_pytorchjob(job: TrainJob) -> KubeflowOrgV1PyTorchJob:
    """The PyTorchJob for `job`: one Master, nnodes-1 Workers, one torchrun per pod."""
    if not job.image:
        raise ValueError(f"TrainJob {job.name!r}: image is required to run on Kubernetes")
    if job.nnodes < 1 or job.nproc_per_node < 1:
        raise ValueError(
            f"TrainJob {job.name!r}: nnodes and nproc_per_node must be >= 1, "
            f"got {job.nnodes} and {job.nproc_per_node}"
        )
    template = _pod_template(job)
    replicas = {
        to.REPLICA_TYPE_MASTER: KubeflowOrgV1ReplicaSpec(
            replicas=1, restart_policy="ExitCode", template=template
        )
    }
    if job.nnodes > 1:
        replicas[to.REPLICA_TYPE_WORKER] = KubeflowOrgV1ReplicaSpec(
            replicas=job.nnodes - 1, restart_policy="ExitCode", template=template
        )
    return KubeflowOrgV1PyTorchJob(
        api_version=PYTORCHJOB.api_version,
        kind=PYTORCHJOB.kind,
        metadata=k8s.V1ObjectMeta(
            name=dns_name(job.name),
            namespace=job.namespace,
            labels={"app.kubernetes.io/managed-by": "kubellm"},
        ),
        spec=KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(job.nproc_per_node),
            pytorch_replica_specs=replicas,
            # Keep finished pods: the master's log is where the metrics are read from.
            run_policy=KubeflowOrgV1RunPolicy(clean_pod_policy="None", backoff_limit=3),
        ),
    )


def pytorchjob_manifest(job: TrainJob) -> dict[str, Any]:
    """`build_pytorchjob` as the JSON body the API server receives."""
    return to_dict(build_pytorchjob(job))


def master_selector(name: str) -> str:
    """Labels the operator puts on the master pod of PyTorchJob `name`."""
    return f"{to.JOB_NAME_LABEL}={name},{to.REPLICA_TYPE_LABEL}={to.REPLICA_TYPE_MASTER.lower()}"


def _pod_template(job: TrainJob) -> k8s.V1PodTemplateSpec:
    env = {"PYTHONUNBUFFERED": "1", **job.env}  # metric lines must reach the log promptly
    mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    # NCCL and DataLoader workers share memory through /dev/shm; the default is 64 MiB.
    volumes = [k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory"))]
    if job.workspace_pvc:
        mounts.append(k8s.V1VolumeMount(name="workspace", mount_path=WORKSPACE_MOUNT))
        volumes.append(
            k8s.V1Volume(
                name="workspace",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                    claim_name=job.workspace_pvc
                ),
            )
        )
    resources = None
    env_from = None
    if job.gpus_per_node > 0:
        resources = k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": str(job.gpus_per_node)})
        # NCCL's fabric settings, when the cluster has them (manifests/overlays/rdma).
        env_from = [
            k8s.V1EnvFromSource(
                config_map_ref=k8s.V1ConfigMapEnvSource(name=NCCL_ENV_CONFIG_MAP, optional=True)
            )
        ]
    container = k8s.V1Container(
        name=CONTAINER,
        image=job.image,
        # torchrun with exit codes for restartPolicy ExitCode (kubellm/train/agent.py).
        command=["python", "-m", "kubellm.train.agent"],
        args=["-m", job.module, *job.train_args],
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()],
        env_from=env_from,
        resources=resources,
        volume_mounts=mounts,
        security_context=container_security(),
    )
    return k8s.V1PodTemplateSpec(
        # Istio sidecars keep pods of finished jobs running (Kubeflow profile namespaces).
        metadata=k8s.V1ObjectMeta(annotations={"sidecar.istio.io/inject": "false"}),
        spec=k8s.V1PodSpec(
            containers=[container],
            volumes=volumes,
            security_context=pod_security(),
        ),
    )


class PyTorchJobTrainer(Trainer):
    """Trainer on a cluster: one PyTorchJob per run, metrics from the master pod's log."""

    def __init__(
        self,
        api_client: k8s.ApiClient | None = None,
        *,
        poll_interval_s: float = 10.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.kube = KubeClient(api_client, poll_interval_s, request_timeout_s)

    def run(self, job: TrainJob) -> JobResult:
        body = pytorchjob_manifest(job)
        name, ns = body["metadata"]["name"], job.namespace
        self.kube.create(PYTORCHJOB, ns, body)

        def failure(obj: dict[str, Any]) -> str | None:
            why = failed_condition(obj)
            return None if why is None else why + self._log_tail(ns, name)

        self.kube.wait(
            PYTORCHJOB,
            ns,
            name,
            job.timeout_s,
            done=lambda obj: condition_is_true(obj, "Succeeded"),
            failure=failure,
        )
        try:
            _, logs = self.kube.pod_log(ns, master_selector(name))
        except Exception as e:  # the metrics are in this log; a result without them misleads
            raise JobFailed(
                f"pytorchjob/{name} in {ns} succeeded but its master pod's log could not be "
                f"read ({e}); the pod must outlive the job (cleanPodPolicy None)"
            ) from e
        return JobResult(name=name, logs=logs, metrics=parse_metrics(logs))

    def _log_tail(self, ns: str, name: str) -> str:
        """The end of the master's log, so a failure explains itself; empty if unreadable."""
        try:
            pod, logs = self.kube.pod_log(ns, master_selector(name))
        except Exception:
            return ""
        tail = "\n".join(logs.rstrip().splitlines()[-_LOG_TAIL_LINES:])
        return f"\n--- last lines of {pod} ---\n{tail}" if tail else ""
