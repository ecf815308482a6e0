"""Run a training request as a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1).

The second cluster training backend (`trainer_backend=trainjob`), beside the Training
Operator v1 PyTorchJob (pytorchjob.py). The pods are the PyTorchJob's (`job_pod_template`):
the same `python -m kubellm.train.agent` entrypoint, resources, fabric, placement, workspace
and MLflow credentials. Trainer v2 splits them in three places (kubeflow/trainer at v2.3.0):

- `spec.trainer` (pkg/apis/trainer/v1alpha1/trainjob_types.go `Trainer`): image, command,
  args, env, numNodes, numProcPerNode, resourcesPerNode of the `node` container;
- `spec.runtimePatches` (same file, `RuntimePatch` .. `PodSpecPatch`, `ContainerPatch`):
  what the trainer fields cannot carry, per pod: labels, annotations, volumes, nodeSelector,
  tolerations, securityContext, terminationGracePeriodSeconds, and the `node` container's
  volumeMounts and securityContext (not its env: pkg/runtime/framework/plugins/jobset/
  jobset.go#L203-L205 refuses env for `node` there, it goes through `spec.trainer.env`);
- the ClusterTrainingRuntime `kubellm-torch` (`training_runtime_manifest`, shipped in
  manifests/cluster/trainer-v2): the torch ML policy, the JobSet with replicatedJob and
  container `node`, and what is per cluster: restart bounds, no service-account token.

The torch plugin (pkg/runtime/framework/plugins/torch/torch.go#L147-L186) injects PET_NNODES,
PET_NPROC_PER_NODE, PET_NODE_RANK (the Job completion index), PET_MASTER_ADDR
(`<name>-node-0-0.<name>`) and PET_MASTER_PORT (29500) into the `node` container: the same
PET_* variables torchrun reads (its `env` argparse defaults) that the Training Operator sets,
so the agent needs nothing else.

Example (a cluster with Trainer v2.3 and `kubectl apply -k manifests/cluster/trainer-v2`):

    TrainJobTrainer(cluster=ClusterSettings(gpus_per_node=8)).run(TrainJob(name="llm-train",
        image="ghcr.io/org/kubellm-trainer:1", train_args=["--config", "/workspace/t.json"],
        nnodes=2, nproc_per_node=8, workspace_pvc="kubellm-workspace", namespace="team-a"))
"""

from __future__ import annotations

import math
from typing import Any

from kubeflow_trainer_api import models as tm

from kubellm.backends.base import JobFailed, JobResult, Trainer, TrainJob, dns_name
from kubellm.backends.kubernetes.client import (
    CustomResource,
    OnCluster,
    condition_is_true,
    failed_condition,
    status_summary,
    to_dict,
)
from kubellm.backends.kubernetes.podspec import KUEUE_QUEUE_LABEL, MANAGED_BY, ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import build_pytorchjob, job_pod_template
from kubellm.train.metric_lines import parse_metrics

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOB = CustomResource(GROUP, VERSION, "trainjobs", "TrainJob")
CLUSTER_TRAINING_RUNTIME = CustomResource(
    GROUP, VERSION, "clustertrainingruntimes", "ClusterTrainingRuntime"
)
RUNTIME_NAME = "kubellm-torch"
# The trainer's replicatedJob and container: pkg/constants/constants.go#L68-L69 `Node`.
NODE = "node"
# pkg/constants/constants.go#L41 LabelTrainJobAncestor; AncestorTrainer (#L66).
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
# torch.go#L68-L76 refuses these in spec.trainer.env (constants.go#L300).
TORCH_RESERVED_ENV = frozenset(
    {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
)
# Our runtimePatches entry (RuntimePatch.manager; Kueue writes its own, keyed apart).
PATCH_MANAGER = "kubellm.dev/trainer"
# JobSet's pod labels (kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go#L24-L36 at
# v0.12.0, the version trainer v2.3.0's go.mod pins) and the Job controller's index label.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# The agent's exits that are no pre-emption (train/agent.py): the Job fails at once and JobSet
# does not restart it (a FailJobSet rule on reason PodFailurePolicy), unlike 200 or a signal.
PERMANENT_EXITS = [1, 2, 3, 4]
# How much later than the step's timeout the TrainJob's activeDeadlineSeconds ends it. The
# step's timeout deletes the TrainJob (its JobSet, Jobs and pods go with it) and says so
# (JobTimeout); Trainer v2 requeues a TrainJob at its deadline (trainjob_controller.go
# reconcileDeadline L155-L191 at v2.3.0, RequeueAfter), counted from the creationTimestamp
# (whole seconds) or the resume, so at the same deadline it would often come first: the step
# would fail with DeadlineExceeded and leave the TrainJob behind. The deadline is the
# backstop for a step that is gone.
DEADLINE_GRACE_S = 60


def _check(job: TrainJob, cluster: ClusterSettings) -> None:
    if cluster.priority_class:
        raise ValueError(
            "priority_class is not supported with trainer_backend=trainjob: Trainer v2.3's "
            "runtimePatches cannot set priorityClassName; set it in the ClusterTrainingRuntime"
        )
    if cluster.queue and cluster.gang_scheduler == "volcano":
        raise ValueError(
            "gang_scheduler=volcano is not supported with trainer_backend=trainjob (a "
            "ClusterTrainingRuntime's podGroupPolicy does that); use kueue"
        )
    reserved = sorted(TORCH_RESERVED_ENV & job.env.keys())
    if reserved:
        raise ValueError(
            f"TrainJob {job.name!r}: env {', '.join(reserved)} is set by Trainer v2's torch "
            "plugin and refused by its webhook"
        )


def build_trainjob(
    job: TrainJob, cluster: ClusterSettings | None = None
) -> tm.TrainerV1alpha1TrainJob:
    """The TrainJob for `job` on ClusterTrainingRuntime RUNTIME_NAME: numNodes pods with one
    torchrun each, the PyTorchJob's pod (`job_pod_template`) split into trainer fields and one
    runtime patch."""
    cluster = cluster or ClusterSettings()
    build_pytorchjob(job, cluster)  # the same argument checks (image, nnodes, nproc)
    _check(job, cluster)
    template = to_dict(job_pod_template(job, cluster))
    pod, (container,) = template["spec"], template["spec"]["containers"]
    pod_patch = {
        "volumes": pod["volumes"],
        "securityContext": pod.get("securityContext"),
        "nodeSelector": pod.get("nodeSelector"),
        "tolerations": pod.get("tolerations"),
        "terminationGracePeriodSeconds": pod.get("terminationGracePeriodSeconds"),
        "containers": [
            {
                "name": NODE,
                "volumeMounts": container["volumeMounts"],
                "securityContext": container["securityContext"],
            }
        ],
    }
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": NODE,
                            "template": {
                                "spec": {
                                    "template": {
                                        "metadata": template["metadata"],
                                        "spec": {
                                            k: v for k, v in pod_patch.items() if v is not None
                                        },
                                    }
                                }
                            },
                        }
                    ]
                }
            }
        },
    }
    trainer = {
        "image": container["image"],
        "command": container["command"],
        "args": container["args"],
        "env": container["env"],
        "numNodes": job.nnodes,
        "numProcPerNode": job.nproc_per_node,
        "resourcesPerNode": container.get("resources"),
    }
    return tm.TrainerV1alpha1TrainJob.from_dict(
        {
            "apiVersion": TRAINJOB.api_version,
            "kind": TRAINJOB.kind,
            "metadata": {
                "name": dns_name(job.name),
                "namespace": job.namespace,
                "labels": cluster.labels(),
            },
            "spec": {
                "runtimeRef": {
                    "name": RUNTIME_NAME,
                    "apiGroup": GROUP,
                    "kind": CLUSTER_TRAINING_RUNTIME.kind,
                },
                "trainer": {k: v for k, v in trainer.items() if v is not None},
                "runtimePatches": [patch],
                # Counted from the start, restarted on resume (Kueue): the step's timeout,
                # plus a grace (DEADLINE_GRACE_S) so the step's own timeout comes first.
                "activeDeadlineSeconds": math.ceil(job.timeout_s) + DEADLINE_GRACE_S,
            },
        }
    )


def trainjob_manifest(job: TrainJob, cluster: ClusterSettings | None = None) -> dict[str, Any]:
    """`build_trainjob` as the JSON body the API server receives."""
    out: dict[str, Any] = build_trainjob(job, cluster).to_dict()
    return out


def build_training_runtime(
    cluster: ClusterSettings | None = None, image: str = ""
) -> tm.TrainerV1alpha1ClusterTrainingRuntime:
    """ClusterTrainingRuntime RUNTIME_NAME: upstream's torch-distributed
    (manifests/base/runtimes/torch_distributed.yaml) with the restart bounds of `cluster`.

    A failed Job restarts the whole JobSet, up to `max_restarts` times (JobSet
    failurePolicy.maxRestarts; the Job itself has backoffLimit 0). The agent's permanent
    exits (PERMANENT_EXITS) fail the Job by its podFailurePolicy and the JobSet at once.

    `image` is the `node` container's default (each TrainJob sets its own). Give one, as
    upstream's runtimes and manifests/cluster/trainer-v2 do: the Kubeflow SDK's TrainerClient
    refuses to read a runtime without it, and so every TrainJob on it (kubeflow/sdk 0.5.0
    backends/kubernetes/utils.py `get_runtime_trainer`; tests/k8s/test_trainer_client.py).
    It also needs the `trainer.kubeflow.org/framework` label and the ancestor label set here.
    """
    cluster = cluster or ClusterSettings()
    container: dict[str, Any] = {"name": NODE}
    if image:
        container["image"] = image
    node_job = {
        "name": NODE,
        "replicas": 1,  # trainingruntime_webhook.go#L78-L81: the trainer's replicatedJob
        "template": {
            "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
            "spec": {
                "backoffLimit": 0,
                "podFailurePolicy": {
                    "rules": [
                        {
                            "action": "FailJob",
                            "onExitCodes": {
                                "containerName": NODE,
                                "operator": "In",
                                "values": PERMANENT_EXITS,
                            },
                        }
                    ]
                },
                "template": {
                    "spec": {
                        "restartPolicy": "Never",  # podFailurePolicy requires it
                        # Training never calls the Kubernetes API: no token in the pod.
                        "automountServiceAccountToken": False,
                        "containers": [container],
                    }
                },
            },
        },
    }
    return tm.TrainerV1alpha1ClusterTrainingRuntime.from_dict(
        {
            "apiVersion": CLUSTER_TRAINING_RUNTIME.api_version,
            "kind": CLUSTER_TRAINING_RUNTIME.kind,
            "metadata": {
                "name": RUNTIME_NAME,
                "labels": {"trainer.kubeflow.org/framework": "torch", **MANAGED_BY},
            },
            "spec": {
                "mlPolicy": {"numNodes": 1, "torch": {}},
                "template": {
                    "spec": {
                        "failurePolicy": {
                            "maxRestarts": cluster.max_restarts,
                            "rules": [
                                {
                                    "name": "permanent-exit",
                                    "action": "FailJobSet",
                                    "onJobFailureReasons": ["PodFailurePolicy"],
                                }
                            ],
                        },
                        "replicatedJobs": [node_job],
                    }
                },
            },
        }
    )


def training_runtime_manifest(
    cluster: ClusterSettings | None = None, image: str = ""
) -> dict[str, Any]:
    """`build_training_runtime` as the JSON body the API server receives."""
    out: dict[str, Any] = build_training_runtime(cluster, image).to_dict()
    return out


def node0_selector(name: str) -> str:
    """The labels of TrainJob `name`'s first node pod (the JobSet is named after it; the
    torch plugin runs numNodes pods as one indexed Job, torch.go#L124-L128)."""
    return (
        f"{JOBSET_NAME_LABEL}={name},{REPLICATED_JOB_LABEL}={NODE},{JOB_INDEX_LABEL}=0,"
        f"{COMPLETION_INDEX_LABEL}=0"
    )


def trainjob_state(obj: dict[str, Any]) -> str:
    """What the step prints on each change: the newest true condition once there is one
    that says something (Complete, Failed, Suspended), else the node Jobs' counts from
    jobsStatus (Trainer v2.3 has no Running condition: trainjob_types.go), e.g.
    `Running (node: 2 active, 2 ready)`."""
    summary = status_summary(obj)
    if summary in ("Complete", "Failed", "Suspended"):
        return summary
    jobs = (obj.get("status") or {}).get("jobsStatus") or []
    counts = [
        f"{j.get('name')}: "
        + ", ".join(f"{j[k]} {k}" for k in ("active", "ready", "succeeded", "failed") if j.get(k))
        for j in jobs
        if any(j.get(k) for k in ("active", "ready", "succeeded", "failed"))
    ]
    if any(j.get("active") for j in jobs):
        return f"Running ({'; '.join(counts)})"
    return f"{summary} ({'; '.join(counts)})" if counts else summary


def trainjob_queued(obj: dict[str, Any]) -> str | None:
    """Why the TrainJob waits, or None: suspended (`spec.suspend`, Kueue's until admission)
    or its `Suspended` condition True (trainjob_types.go TrainJobSuspended)."""
    suspended = bool((obj.get("spec") or {}).get("suspend"))
    if not suspended and not condition_is_true(obj, "Suspended"):
        return None
    queue = ((obj.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    return f"suspended, queue {queue}" if queue else "suspended"


class TrainJobTrainer(OnCluster, Trainer):
    """Trainer on a cluster with Kubeflow Trainer v2: one TrainJob per run, metrics from the
    node-0 pod's log."""

    def run(self, job: TrainJob) -> JobResult:
        """Create (or adopt, or replace) the TrainJob, stream node 0's log, and return its
        metrics; JobFailed with the controller's reason (`Failed` condition) otherwise."""
        body = trainjob_manifest(job, self.cluster)
        name, ns = body["metadata"]["name"], job.namespace
        outcome = self.kube.run(
            TRAINJOB,
            ns,
            body,
            timeout_s=job.timeout_s,
            # trainjob_types.go TrainJobComplete / TrainJobFailed
            done=lambda obj: condition_is_true(obj, "Complete"),
            failure=failed_condition,
            describe=trainjob_state,
            follow_logs=node0_selector(name),
            log_container=NODE,
            queued=trainjob_queued,
        )
        if outcome.log_error is not None:
            raise JobFailed(
                f"trainjob/{name} in {ns} completed but its node-0 pod's log could not be "
                f"read ({outcome.log_error})"
            )
        return JobResult(name=name, logs=outcome.logs, metrics=parse_metrics(outcome.logs))

    def release(self, run_tag: str, namespace: str) -> list[str]:
        """Delete every TrainJob labelled with run `run_tag` (the exit handler's cleanup)."""
        from kubellm.backends.kubernetes.release import delete_run_objects

        return delete_run_objects(self.kube, TRAINJOB, namespace, run_tag)
