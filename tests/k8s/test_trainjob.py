"""Trainer v2 TrainJobs (kubellm.backends.kubernetes.trainjob): every body the builder makes
validates strictly against the vendored kubeflow/trainer v2.3.0 CRDs and the webhook rules
cited below, its pods are the PyTorchJob's pods, and the trainer drives a TrainJob through
the fake API server as PyTorchJobTrainer drives a PyTorchJob.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from fakes import fake_k8s as fake_k8s_module
from fakes.fake_k8s import FakeK8s, Kind
from fakes.k8s_schemas import crd_check, crds_dir, metadata_errors
from fakes.trainer_v2 import runtime_webhook_errors, trainjob_name_errors, trainjob_webhook_errors
from kubellm.backends.base import JobFailed, TrainJob
from kubellm.backends.kubernetes.client import to_dict
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import job_pod_template
from kubellm.backends.kubernetes.trainjob import (
    DEADLINE_GRACE_S,
    NODE,
    RUNTIME_NAME,
    TrainJobTrainer,
    node0_selector,
    training_runtime_manifest,
    trainjob_manifest,
    trainjob_queued,
)

from .conftest import POLL_S

TRAINJOB_CRD = "trainer.kubeflow.org_trainjobs.yaml"
RUNTIME_CRD = "trainer.kubeflow.org_clustertrainingruntimes.yaml"
LOG = "step=10 loss=2.5\neval_loss=1.75\n"


def job(**overrides: Any) -> TrainJob:
    base: dict[str, Any] = {
        "name": "llm-train",
        "image": "ghcr.io/example/kubellm-trainer:test",
        "train_args": ["--config", "/workspace/run/train.json"],
        "timeout_s": 10.0,
    }
    return TrainJob(**{**base, **overrides})


@dataclass
class Case:
    name: str
    cluster: ClusterSettings
    job: dict[str, Any] = field(default_factory=dict)


GPU = {"gpus_per_node": 8, "cpu": "32", "memory": "256Gi"}
CASES = [
    Case("defaults-cpu", ClusterSettings()),
    Case("gpu-tcp-2-nodes", ClusterSettings(**GPU), {"nnodes": 2, "nproc_per_node": 8}),
    Case(
        "rdma-ib",
        ClusterSettings(**GPU, fabric="rdma-ib", rdma_resource="rdma/ib"),
        {"nnodes": 4, "nproc_per_node": 8, "workspace_pvc": "kubellm-workspace"},
    ),
    Case(
        "roce-multus-nccl-overrides",
        ClusterSettings(
            **GPU,
            fabric="roce",
            rdma_count=2,
            network_annotation="roce-net",
            nccl_env={"NCCL_IB_HCA": "mlx5_0"},
        ),
        {"nnodes": 2, "nproc_per_node": 8},
    ),
    Case(
        "kueue-placement-run-labels",
        ClusterSettings(
            **GPU,
            queue="team-a",
            node_selector={"nvidia.com/gpu.product": "H100"},
            tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            run_id="3f0c2a1e-77b1",
            grace_seconds=600,
            ttl_seconds=3600,
        ),
        {"nnodes": 2, "nproc_per_node": 8, "namespace": "team-a"},
    ),
    Case(
        "fsdp-lora-args-fabric-module",
        ClusterSettings(**GPU),
        {
            "module": "kubellm.train.fabric",
            "train_args": ["--config", "/w/c.json", "--set", "fsdp=true", "--set", "lora_r=8"],
            "env": {"KUBELLM_EXTRA": "1"},
        },
    ),
    Case("long-name", ClusterSettings(), {"name": "x" * 80}),
]


def webhook_errors(body: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """What Trainer v2.3.0's admission refuses that the CRD schema does not say, as the
    simulated Trainer v2 refuses it (tests/fakes/trainer_v2.py; rows of UPSTREAM.md)."""
    return trainjob_name_errors(body) + trainjob_webhook_errors(body, runtime)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_trainjob_and_runtime_validates_strictly(case: Case) -> None:
    body = trainjob_manifest(job(**case.job), case.cluster)
    runtime = training_runtime_manifest(case.cluster, "ghcr.io/example/kubellm-trainer:test")
    assert crd_check(crds_dir() / TRAINJOB_CRD, "v1alpha1")(body) == []
    assert metadata_errors(body) == []
    assert webhook_errors(body, runtime) == []
    assert crd_check(crds_dir() / RUNTIME_CRD, "v1alpha1")(runtime) == []
    assert runtime_webhook_errors(runtime) == []
    assert runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == (
        case.cluster.max_restarts
    )


def test_the_checks_fail_on_what_upstream_refuses() -> None:
    body = trainjob_manifest(job(), ClusterSettings())
    runtime = training_runtime_manifest()
    bad = copy.deepcopy(body)
    bad["spec"]["trainer"]["nprocPerNode"] = 8  # the v1 PyTorchJob's spelling
    assert crd_check(crds_dir() / TRAINJOB_CRD, "v1alpha1")(bad)
    bad = copy.deepcopy(body)
    bad["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "2"})
    bad["metadata"]["name"] = "9-starts-with-a-digit"
    env = bad["spec"]["trainer"]["env"]
    assert webhook_errors(bad, runtime) == [
        "metadata.name must match RFC 1035 DNS label format",
        f"spec.trainer.env: Invalid value: {json.dumps(env, sort_keys=True)}: must not have "
        "reserved envs, invalid envs configured: [PET_NNODES]",
    ]
    bad = copy.deepcopy(body)
    rjob = bad["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    rjob["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "A", "value": "1"}
    ]
    (error,) = webhook_errors(bad, runtime)
    assert error.startswith("spec.runtimePatches: Invalid value: ") and error.endswith(
        ": must not have envs for the dataset-initializer, model-initializer, node containers"
    )
    bad_runtime = copy.deepcopy(runtime)
    bad_runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["replicas"] = 2
    assert runtime_webhook_errors(bad_runtime) == [
        "spec.template.spec.replicatedJobs[0].replicas: Invalid value: 2: always must be 1"
    ]


def applied_pod(body: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """The node pod template Trainer v2 makes from the runtime, the trainer fields
    (plugins/jobset/builder.go Trainer) and the runtime patch (jobset.go), simplified: each
    field our patch sets replaces the runtime's, which sets none of them."""
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    template = copy.deepcopy(rjob["template"]["spec"]["template"])
    (container,) = template["spec"]["containers"]
    trainer = body["spec"]["trainer"]
    container.update({k: trainer[k] for k in ("image", "command", "args", "env")})
    if "resourcesPerNode" in trainer:
        container["resources"] = trainer["resourcesPerNode"]
    (patch,) = body["spec"]["runtimePatches"]
    (prj,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod_patch = copy.deepcopy(prj["template"]["spec"]["template"])
    template["metadata"] = pod_patch["metadata"]
    (cpatch,) = pod_patch["spec"].pop("containers")
    container.update({k: v for k, v in cpatch.items() if k != "name"})
    template["spec"].update(pod_patch["spec"])
    return template


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_node_pod_is_the_pytorchjobs_pod(case: Case) -> None:
    """Everything job_pod_template gives a PyTorchJob's pods reaches the TrainJob's node pod
    (container `node` instead of `pytorch`; restartPolicy Never from the runtime)."""
    train_job = job(**case.job)
    body = trainjob_manifest(train_job, case.cluster)
    pod = applied_pod(body, training_runtime_manifest(case.cluster))
    expected = to_dict(job_pod_template(train_job, case.cluster))
    expected["spec"]["containers"][0]["name"] = NODE
    expected["spec"]["restartPolicy"] = "Never"
    assert pod == expected
    assert body["spec"]["trainer"]["numNodes"] == train_job.nnodes
    assert body["spec"]["trainer"]["numProcPerNode"] == train_job.nproc_per_node
    assert body["spec"]["runtimeRef"]["name"] == RUNTIME_NAME
    deadline = math.ceil(train_job.timeout_s) + DEADLINE_GRACE_S  # after the step's timeout
    assert body["spec"]["activeDeadlineSeconds"] == deadline
    assert body["metadata"]["labels"] == case.cluster.labels()


@pytest.mark.parametrize(
    ("cluster", "overrides", "match"),
    [
        (ClusterSettings(priority_class="high"), {}, "priority_class is not supported"),
        (ClusterSettings(queue="q", gang_scheduler="volcano"), {}, "volcano is not supported"),
        (ClusterSettings(), {"env": {"PET_MASTER_PORT": "1"}}, "PET_MASTER_PORT is set by"),
        (ClusterSettings(), {"image": ""}, "image is required"),
    ],
)
def test_options_trainer_v2_cannot_carry_are_clear_errors(
    cluster: ClusterSettings, overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        trainjob_manifest(job(**overrides), cluster)


def test_node0_selector_uses_jobsets_labels() -> None:
    assert node0_selector("j") == (
        "jobset.sigs.k8s.io/jobset-name=j,jobset.sigs.k8s.io/replicatedjob-name=node,"
        "jobset.sigs.k8s.io/job-index=0,batch.kubernetes.io/job-completion-index=0"
    )


def test_queued_while_suspended() -> None:
    meta = {"labels": {"kueue.x-k8s.io/queue-name": "team-a"}}
    assert trainjob_queued({"metadata": meta, "spec": {"suspend": True}}) == (
        "suspended, queue team-a"
    )
    resumed = {"type": "Suspended", "status": "False", "reason": "Resumed"}
    assert (
        trainjob_queued({"spec": {"suspend": False}, "status": {"conditions": [resumed]}}) is None
    )


# ------------------------------------------------------------------ against the fake server


@pytest.fixture
def fake(fake_k8s: FakeK8s, monkeypatch: pytest.MonkeyPatch) -> FakeK8s:
    # The simulated cluster's own Trainer v2 support is another slice; until it lands the
    # fake serves trainjobs with its generic object store (no schema check there: this
    # file checks the bodies itself, above).
    if "trainjobs" not in fake_k8s_module.RESOURCES:
        monkeypatch.setitem(
            fake_k8s_module.RESOURCES,
            "trainjobs",
            Kind("trainer.kubeflow.org", "v1alpha1", "TrainJob"),
        )
    return fake_k8s


def add_node_pods(fake: FakeK8s, name: str = "llm-train", nodes: int = 2) -> None:
    """The node pods JobSet creates for TrainJob `name` (JobSet named after it): one Job,
    completion index = node rank; node 0 prints LOG, the others nothing."""

    def create(fake: FakeK8s, obj: dict[str, Any]) -> None:
        if obj["metadata"]["name"] != name:
            return
        for rank in range(nodes):
            fake.add_pod(
                "default",
                f"{name}-node-0-{rank}-abcde",
                {
                    "jobset.sigs.k8s.io/jobset-name": name,
                    "jobset.sigs.k8s.io/replicatedjob-name": NODE,
                    "jobset.sigs.k8s.io/job-index": "0",
                    "batch.kubernetes.io/job-completion-index": str(rank),
                },
                log=LOG if rank == 0 else "eval_loss=9\n",
                spec={"containers": [{"name": NODE, "image": "trainer"}]},
            )

    fake.on_create("trainjobs", create)


RUNNING = {"conditions": []}
# metav1.Condition: type, status, lastTransitionTime, reason and message are required (the
# vendored CRD's schema, which the fake checks status updates against); Trainer v2 copies the
# JobSet's terminal condition (plugins/jobset/jobset.go, tests/fakes/trainer_v2.py)
T0 = "2026-12-02T00:00:00Z"
COMPLETE = {
    "conditions": [
        {
            "type": "Complete",
            "status": "True",
            "reason": "AllJobsCompleted",
            "message": "jobset completed successfully",
            "lastTransitionTime": T0,
        }
    ]
}
FAILED = {
    "conditions": [
        {
            "type": "Failed",
            "status": "True",
            "reason": "ReachedMaxRestarts",
            "message": "node failed",
            "lastTransitionTime": T0,
        }
    ]
}


def test_success_returns_node0s_log_and_metrics(fake: FakeK8s) -> None:
    fake.script_status("trainjobs", "llm-train", [RUNNING, COMPLETE])
    add_node_pods(fake)
    result = TrainJobTrainer(fake.api_client(), poll_interval_s=POLL_S).run(job(nnodes=2))
    assert result.metrics == {"step": 10.0, "loss": 2.5, "eval_loss": 1.75}
    assert fake.errors == []
    (created,) = fake.created("trainjobs")
    assert created["spec"]["trainer"]["numNodes"] == 2


def test_failed_condition_is_a_job_failure(fake: FakeK8s) -> None:
    fake.script_status("trainjobs", "llm-train", [RUNNING, FAILED])
    add_node_pods(fake)
    with pytest.raises(JobFailed, match="ReachedMaxRestarts: node failed"):
        TrainJobTrainer(fake.api_client(), poll_interval_s=POLL_S).run(job())


def test_release_deletes_the_runs_trainjobs(fake: FakeK8s) -> None:
    cluster = ClusterSettings(run_id="run-1")
    fake.script_status("trainjobs", "llm-train", [COMPLETE])
    add_node_pods(fake, nodes=1)
    trainer = TrainJobTrainer(fake.api_client(), cluster=cluster, poll_interval_s=POLL_S)
    trainer.run(job())
    assert trainer.release("run-1", "default") == ["trainjob/llm-train in default: deleted"]
    assert fake.get_object("trainjobs", "llm-train") is None
    assert fake.errors == []


@pytest.mark.parametrize(
    ("backend", "kind"), [("pytorchjob", "PyTorchJob"), ("trainjob", "TrainJob")]
)
def test_trainer_backend_selects_the_trainer(backend: str, kind: str) -> None:
    from kubellm.backends import select
    from kubellm.config import pipeline_config

    cfg = pipeline_config({"platform": "kubernetes", "trainer_backend": backend})
    assert type(select(cfg, "run-1").trainer).__name__ == f"{kind}Trainer"


def test_the_state_the_step_prints_comes_from_the_node_jobs_while_it_runs() -> None:
    # Trainer v2.3 writes no Running condition: without jobsStatus every running TrainJob
    # would print (and time out as) `Pending`
    from kubellm.backends.kubernetes.trainjob import trainjob_state

    def state(status: dict[str, Any]) -> str:
        return trainjob_state({"status": status})

    node = {"name": "node", "active": 2, "ready": 2, "succeeded": 0, "failed": 0}
    assert state({}) == "Pending"
    assert state({"jobsStatus": [node]}) == "Running (node: 2 active, 2 ready)"
    complete = {"type": "Complete", "status": "True", "reason": "AllJobsCompleted"}
    done = {**node, "active": 0, "ready": 0, "succeeded": 1}
    assert state({"conditions": [complete], "jobsStatus": [done]}) == "Complete"
    suspended = {"type": "Suspended", "status": "True", "reason": "Suspended"}
    assert state({"conditions": [suspended]}) == "Suspended"
    resumed = {**suspended, "status": "False", "reason": "Resumed"}
    assert state({"conditions": [resumed], "jobsStatus": [node]}).startswith("Running (node:")
