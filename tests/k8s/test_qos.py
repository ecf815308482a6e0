"""Pod QoS as the API server computes it (tests/fakes/qos.py), for our training and trial pods.

`ClusterSettings.resources()` sets equal cpu/memory requests and limits on the `pytorch`
container. Whether a pod is Guaranteed depends on every container, init containers included:
the Training Operator's `init-pytorch` (worker pods) and Katib's metrics collector (trial
master pods) bring resources of their own. The sim's node has no GPU while the pods ask for
one, so the pods stay Pending and no process runs; their qosClass is set at creation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client as k8s

from fakes.qos import BEST_EFFORT, BURSTABLE, GUARANTEED, pod_qos
from fakes.sim_cluster import SimCluster
from kubellm.backends.base import SearchParam, TrainJob, TuneRequest
from kubellm.backends.kubernetes.katib import build_experiment
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import pytorchjob_manifest

CLUSTER = ClusterSettings(gpus_per_node=1, cpu="4", memory="16Gi")


@dataclass(frozen=True)
class Case:
    name: str
    containers: list[dict[str, Any]]
    want: str
    init: tuple[dict[str, Any], ...] = ()


def c(requests: dict[str, str] | None = None, limits: dict[str, str] | None = None) -> dict:
    res = {k: v for k, v in (("requests", requests), ("limits", limits)) if v is not None}
    return {"name": "c", "image": "i", "resources": res}


EQUAL = c({"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"})
CASES = [  # after pkg/apis/core/helper/qos/qos_test.go's cases
    Case("nothing set", [c()], BEST_EFFORT),
    Case("only extended resources", [c(limits={"nvidia.com/gpu": "8"})], BEST_EFFORT),
    Case("zero quantities", [c({"cpu": "0"}, {"memory": "0"})], BEST_EFFORT),
    Case("equal cpu and memory", [EQUAL], GUARANTEED),
    Case("limits only (requests default to them)", [c(limits={"cpu": "1", "memory": "1Gi"})],
         GUARANTEED),
    Case("equal, as different spellings", [c({"cpu": "1000m", "memory": "1024Mi"},
                                            {"cpu": "1", "memory": "1Gi"})], GUARANTEED),
    Case("equal plus a GPU", [c({"cpu": "1", "memory": "1Gi"},
                                 {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"})],
         GUARANTEED),
    Case("requests only", [c({"cpu": "1", "memory": "1Gi"})], BURSTABLE),
    Case("cpu limit only", [c(limits={"cpu": "1"})], BURSTABLE),
    Case("request below limit", [c({"cpu": "1", "memory": "1Gi"}, {"cpu": "2", "memory": "1Gi"})],
         BURSTABLE),
    Case("one container unset", [EQUAL, c()], BURSTABLE),
    Case("an unequal init container", [EQUAL], BURSTABLE,
         (c({"cpu": "50m", "memory": "10Mi"}, {"cpu": "100m", "memory": "20Mi"}),)),
    Case("an equal init container", [EQUAL], GUARANTEED, (EQUAL,)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_pod_qos(case: Case) -> None:
    spec: dict[str, Any] = {"containers": case.containers}
    if case.init:
        spec["initContainers"] = list(case.init)
    assert pod_qos({"spec": spec}) == case.want


# `sim`: tests/k8s/conftest.py (the repo's Role; no errors, nothing forbidden)


def wait_pods(sim: SimCluster, n: int, what: str) -> dict[str, dict[str, Any]]:
    """The `n` pods once all exist and the scheduler has written their status (Pending,
    Unschedulable: a status write after the create, which must keep qosClass)."""

    def ready() -> dict[str, dict[str, Any]] | None:
        pods = sim.fake.list_objects("pods", "default")
        scheduled = [
            p
            for p in pods
            if any(
                cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable"
                for cond in (p.get("status") or {}).get("conditions") or []
            )
        ]
        return {p["metadata"]["name"]: p for p in pods} if len(scheduled) == n else None

    found: dict[str, dict[str, Any]] = sim.wait_for(ready, timeout_s=15, what=what)
    return found


def test_training_pods(sim: SimCluster) -> None:
    """The master pod is Guaranteed; a worker is Burstable: init-pytorch requests 50m/10Mi
    and limits 100m/20Mi."""
    job = TrainJob(name="llm-train", train_args=[], nnodes=2, image="ghcr.io/kubellm/t:1")
    k8s.CustomObjectsApi(sim.api_client()).create_namespaced_custom_object(
        "kubeflow.org", "v1", "default", "pytorchjobs", pytorchjob_manifest(job, CLUSTER)
    )
    pods = wait_pods(sim, 2, "both training pods Unschedulable")
    master, worker = pods["llm-train-master-0"], pods["llm-train-worker-0"]
    assert master["status"]["qosClass"] == GUARANTEED
    assert [i["name"] for i in worker["spec"]["initContainers"]] == ["init-pytorch"]
    assert worker["status"]["qosClass"] == BURSTABLE
    for pod in (master, worker):  # what the API server stored is what the rule computes
        assert pod["status"]["qosClass"] == pod_qos(pod)


def test_trial_pods(sim: SimCluster) -> None:
    """A trial's master pod carries Katib's metrics collector sidecar (its own requests and
    limits, katib-config defaults 50m/10Mi and 500m/100Mi): Burstable."""
    trial = TrainJob(name="llm-tune", train_args=[], nnodes=1, image="ghcr.io/kubellm/t:1")
    request = TuneRequest(
        name="llm-tune",
        trial_job=trial,
        space=[SearchParam(name="lr", low=1e-4, high=1e-2)],
        max_trials=1,
        algorithm="random",
    )
    k8s.CustomObjectsApi(sim.api_client()).create_namespaced_custom_object(
        "kubeflow.org", "v1beta1", "default", "experiments", build_experiment(request, CLUSTER)
    )
    [pod] = wait_pods(sim, 1, "the trial's master pod Unschedulable").values()
    assert [x["name"] for x in pod["spec"]["containers"]] == [
        "pytorch",
        "metrics-logger-and-collector",
    ]
    assert pod["status"]["qosClass"] == BURSTABLE == pod_qos(pod)
