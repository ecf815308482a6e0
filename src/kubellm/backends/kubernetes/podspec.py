"""What a cluster run adds to the pods of every job it creates: resources, placement, the
fabric profile, credentials and the labels that tie a job to its pipeline run.

`ClusterSettings.from_config` is the one mapping from the pipeline's cluster parameters to
pod settings; the PyTorchJob trainer, the Katib trials (the same PyTorchJob) and
`kubellm render` all build pods through `job_pod_template`.

Fabric profiles (`fabric`):

| profile | RDMA device | IPC_LOCK | NCCL settings (defaults; `nccl_env` overrides any) |
|---|---|---|---|
| tcp | no | no | none: NCCL picks its transport itself |
| rdma-ib | `rdma_resource` x `rdma_count` | yes | NCCL_IB_DISABLE=0, NCCL_IB_HCA=mlx5, NCCL_SOCKET_IFNAME=eth0, NCCL_NET_GDR_LEVEL=PHB, NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET |
| roce | as rdma-ib | yes | as rdma-ib, plus NCCL_IB_GID_INDEX=3 (RoCE v2 over IPv4) |

IPC_LOCK lets a root process pin memory for RDMA past the container's memlock limit; our
training processes run as uid 10001, where it stays in the bounding set only
(kubernetes/kubernetes#56374), so the node runtime's memlock limit must be unlimited (the
fabric check fails naming it otherwise). IPC_LOCK is outside the "baseline" Pod Security
level, which is why `overlays/rdma` enforces "privileged" and the other overlays do not need to.
"""  # noqa: E501

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s

from kubellm.backends.nccl import fabric_env
from kubellm.config import PipelineConfig

# Credentials for an authenticated MLflow server: a Secret the cluster operator creates
# (never a pipeline parameter). Steps and job pods load the same keys, each optional.
MLFLOW_SECRET = "mlflow-credentials"
MLFLOW_SECRET_ENV = {
    "MLFLOW_TRACKING_USERNAME": "username",
    "MLFLOW_TRACKING_PASSWORD": "password",
    "MLFLOW_TRACKING_TOKEN": "token",
}
# Labels on every object a run creates: `kubectl get pytorchjobs -l kubellm.dev/run=<id>`.
MANAGED_BY = {"app.kubernetes.io/managed-by": "kubellm"}
RUN_LABEL = "kubellm.dev/run"
# On training pods only: manifests/base/jobs-networkpolicy.yaml admits traffic to them from
# this namespace alone.
COMPONENT_LABEL = {"kubellm.dev/component": "training"}
# Kueue admits a job when its queue has room for all of its pods (gang scheduling), with its
# `kubeflow.org/pytorchjob` integration on (off in the manifests Kueue ships) for PyTorchJobs,
# `trainer.kubeflow.org/trainjob` (on there) for TrainJobs. The label goes on the job only: on
# a pod, Kueue's pod integration would queue each pod on its own.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
GPU_RESOURCE = "nvidia.com/gpu"


def label_value(text: str) -> str:
    """`text` as a valid label value (63 characters of [A-Za-z0-9-_.], alphanumeric ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


@dataclass(frozen=True)
class ClusterSettings:
    """Pod-level settings of a run's jobs (see the module docstring for the fabric table)."""

    gpus_per_node: int = 0
    cpu: str = ""  # request and limit; empty: none
    memory: str = ""
    shm_size: str = "8Gi"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    priority_class: str = ""
    queue: str = ""
    gang_scheduler: str = "kueue"
    ttl_seconds: int | None = None  # ttlSecondsAfterFinished
    grace_seconds: int | None = None  # pods' terminationGracePeriodSeconds (the SIGTERM save)
    max_restarts: int = 3  # pod recreations a job may have before the step deletes it
    # elastic PyTorchJob (elasticPolicy): 0 is a fixed-size job; else its minReplicas, and
    # torchrun's worker-group restarts in each pod (maxRestarts)
    elastic_min_nodes: int = 0
    elastic_max_restarts: int = 3
    fabric: str = "tcp"
    rdma_resource: str = "rdma/rdma_shared_device_a"
    rdma_count: int = 1
    network_annotation: str = ""
    nccl_env: dict[str, str] = field(default_factory=dict)
    run_id: str = ""  # the KFP run: a label on every object, for listing and cleanup

    @classmethod
    def from_config(cls, cfg: PipelineConfig, kfp_run_id: str = "") -> ClusterSettings:
        return cls(
            gpus_per_node=cfg.gpus_per_node,
            cpu=cfg.job_cpu,
            memory=cfg.job_memory,
            shm_size=cfg.shm_size,
            node_selector=dict(cfg.node_selector),
            tolerations=[dict(t) for t in cfg.tolerations],
            priority_class=cfg.priority_class,
            queue=cfg.queue,
            gang_scheduler=cfg.gang_scheduler,
            ttl_seconds=cfg.job_ttl_hours * 3600,
            grace_seconds=cfg.job_grace_seconds,
            max_restarts=cfg.job_max_restarts,
            elastic_min_nodes=cfg.elastic_min_nodes,
            elastic_max_restarts=cfg.elastic_max_restarts,
            fabric=cfg.fabric,
            rdma_resource=cfg.rdma_resource,
            rdma_count=cfg.rdma_count,
            network_annotation=cfg.network_annotation,
            nccl_env=dict(cfg.nccl_env),
            run_id=kfp_run_id,
        )

    @property
    def rdma(self) -> bool:
        return self.fabric != "tcp"

    def nccl(self) -> dict[str, str]:
        """The profile's NCCL settings with the run's overrides on top."""
        return fabric_env(self.fabric, self.nccl_env)

    def labels(self, *, pod: bool = False) -> dict[str, str]:
        """Labels of every job object, or (`pod`) of its pods through templates: the same
        minus Kueue's queue label, which must sit on the job alone (KUEUE_QUEUE_LABEL)."""
        out = dict(MANAGED_BY)
        if self.run_id and (value := label_value(self.run_id)):
            out[RUN_LABEL] = value
        if self.queue and self.gang_scheduler == "kueue" and not pod:
            out[KUEUE_QUEUE_LABEL] = self.queue
        return out

    def resources(self) -> k8s.V1ResourceRequirements | None:
        """The `pytorch` container's resources: cpu and memory requests equal to limits;
        GPUs and RDMA devices are extended resources, set as limits.

        A pod is Guaranteed QoS (its cores pinnable by the kubelet's CPU manager) only when
        every container, init containers included, has equal cpu and memory requests and
        limits. That holds for a training job's master pod when cpu and memory are set. It
        does not hold for worker pods, which the Training Operator gives its `init-pytorch`
        init container (requests 50m/10Mi, limits 100m/20Mi), nor for Katib trial master
        pods, which get Katib's metrics collector sidecar (50m/10Mi, limits 500m/100Mi):
        both are Burstable unless the cluster sets equal requests and limits for those
        (tests/k8s/test_qos.py)."""
        requests = {k: v for k, v in (("cpu", self.cpu), ("memory", self.memory)) if v}
        limits = dict(requests)
        if self.gpus_per_node:
            limits[GPU_RESOURCE] = str(self.gpus_per_node)
        if self.rdma:
            limits[self.rdma_resource] = str(self.rdma_count)
        if not limits:
            return None
        return k8s.V1ResourceRequirements(requests=requests or None, limits=limits)

    def annotations(self) -> dict[str, str]:
        # Istio sidecars keep pods of finished jobs running (Kubeflow profile namespaces).
        out = {"sidecar.istio.io/inject": "false"}
        if self.network_annotation:
            out[MULTUS_ANNOTATION] = self.network_annotation
        return out


def secret_env(secret: str, keys: dict[str, str]) -> list[k8s.V1EnvVar]:
    """Environment variables from an optional Secret's keys (absent Secret: unset)."""
    return [
        k8s.V1EnvVar(
            name=env,
            value_from=k8s.V1EnvVarSource(
                secret_key_ref=k8s.V1SecretKeySelector(name=secret, key=key, optional=True)
            ),
        )
        for env, key in keys.items()
    ]


def toleration(raw: dict[str, Any]) -> k8s.V1Toleration:
    """A toleration from its API form (`tolerationSeconds` etc.), as the pipeline's
    `tolerations` and `serving_tolerations` hold it; unknown keys are errors."""
    names = {v: k for k, v in k8s.V1Toleration.attribute_map.items()}
    unknown = sorted(set(raw) - names.keys())
    if unknown:
        raise ValueError(f"toleration {raw}: unknown field(s) {', '.join(unknown)}")
    return k8s.V1Toleration(**{names[k]: v for k, v in raw.items()})
