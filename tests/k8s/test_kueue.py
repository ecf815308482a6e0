"""Gang scheduling through Kueue v0.19.0 on the simulated cluster (tests/fakes/kueue.py).

With `queue` and `gang_scheduler=kueue`, the training job must be ONE Kueue Workload
admitted all at once. That needs the queue label on the PyTorchJob alone and Kueue's
`kubeflow.org/pytorchjob` integration on (off in the manifests Kueue ships). With the label
on the pod templates too, Kueue's pod integration (on by default) makes each pod its own
Workload and admits them one by one: half a job can hold quota while the other half waits.

The sim's node has no GPU while the pods ask for one, so admitted pods stay Pending
(Unschedulable) and no process runs: these tests watch Kueue's decisions, not training.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from fakes.kueue import ADMISSION_GATE, MANAGED_LABEL, QUEUE_LABEL, KueueSettings
from fakes.sim_cluster import SimCluster
from kubellm.backends.base import TrainJob
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import pytorchjob_manifest

QUEUE = "team-a"
CLUSTER = ClusterSettings(queue=QUEUE, gang_scheduler="kueue", gpus_per_node=1)
# Kueue as its manifests ship it (no pytorchjob integration), and as the README says to run it.
SHIPPED = KueueSettings(queues={QUEUE: {"pods": 2, "nvidia.com/gpu": 2}})
ENABLED = SHIPPED.with_pytorchjob()


def training_job(name: str = "llm-train") -> dict[str, Any]:
    """The 2-pod PyTorchJob (Master + 1 Worker, one GPU each) our trainer creates."""
    job = TrainJob(name=name, train_args=[], nnodes=2, image="ghcr.io/kubellm/trainer:test")
    return pytorchjob_manifest(job, CLUSTER)


def pod_labelled(body: dict[str, Any]) -> dict[str, Any]:
    """The same job with the queue label on the pod templates as well (main before the
    fix put it there through `ClusterSettings.labels()`)."""
    body = copy.deepcopy(body)
    for spec in body["spec"]["pytorchReplicaSpecs"].values():
        spec["template"]["metadata"]["labels"][QUEUE_LABEL] = QUEUE
    return body


@contextmanager
def cluster(tmp_path: Path, kueue: KueueSettings) -> Iterator[SimCluster]:
    with SimCluster(tmp_path, kueue=kueue) as sim:
        yield sim
        assert sim.errors == [] and sim.fake.errors == [] and sim.fake.forbidden == []


def create(sim: SimCluster, body: dict[str, Any]) -> dict[str, Any]:
    api = k8s.CustomObjectsApi(sim.api_client())
    out: dict[str, Any] = api.create_namespaced_custom_object(
        "kubeflow.org", "v1", "default", "pytorchjobs", body
    )
    return out


def workloads(sim: SimCluster) -> list[dict[str, Any]]:
    assert sim.kueue is not None
    return sim.kueue.workloads()


def admitted(sim: SimCluster) -> list[dict[str, Any]]:
    assert sim.kueue is not None
    return [w for w in workloads(sim) if sim.kueue.admitted(w)]


def pod_counts(workload: dict[str, Any]) -> dict[str, int]:
    return {ps["name"]: ps["count"] for ps in workload["spec"]["podSets"]}


def pending_message(workload: dict[str, Any]) -> str:
    for c in (workload.get("status") or {}).get("conditions") or []:
        if c["type"] == "QuotaReserved" and c["status"] == "False":
            return str(c["message"])
    return ""


def both_pods(sim: SimCluster) -> list[dict[str, Any]]:
    """The job's two pods, once the operator has created both."""
    return sim.wait_for(
        lambda: (
            len(sim.fake.list_objects("pods", "default")) == 2
            and sim.fake.list_objects("pods", "default")
        ),
        timeout_s=10,
        what="both pods created",
    )


def scheduled_reason(sim: SimCluster, pod: str) -> str:
    status = (sim.fake.get_object("pods", pod) or {}).get("status") or {}
    for cond in status.get("conditions") or []:
        if cond["type"] == "PodScheduled":
            return str(cond.get("reason") or "")
    return ""


def test_the_queue_label_is_on_the_job_not_on_its_pods() -> None:
    body = training_job()
    assert body["metadata"]["labels"][QUEUE_LABEL] == QUEUE
    for rtype, spec in body["spec"]["pytorchReplicaSpecs"].items():
        labels = spec["template"]["metadata"]["labels"]
        assert QUEUE_LABEL not in labels, f"{rtype} pods carry {QUEUE_LABEL}"
        assert labels["app.kubernetes.io/managed-by"] == "kubellm"  # the other labels stay


def test_the_training_job_is_one_workload_admitted_whole(tmp_path: Path) -> None:
    """Acceptance 5: with the pytorchjob integration on, the 2-pod job is one Workload of
    2 pods; the job is created suspended and Kueue unsuspends it on admission."""
    with cluster(tmp_path, ENABLED) as sim:
        created = create(sim, training_job())
        assert created["spec"]["runPolicy"]["suspend"] is True  # Kueue's job webhook
        sim.wait_for(lambda: admitted(sim), timeout_s=10, what="the workload admitted")
        [workload] = workloads(sim)
        assert workload["metadata"]["name"].startswith("pytorchjob-llm-train-")
        assert workload["spec"]["queueName"] == QUEUE
        assert pod_counts(workload) == {"master": 1, "worker": 1}
        usage = {
            a["name"]: a["resourceUsage"]
            for a in workload["status"]["admission"]["podSetAssignments"]
        }
        assert usage == {
            "master": {"nvidia.com/gpu": "1", "pods": "1"},
            "worker": {"nvidia.com/gpu": "1", "pods": "1"},
        }
        sim.wait_for(
            lambda: (
                (sim.fake.get_object("pytorchjobs", "llm-train") or {})["spec"]["runPolicy"][
                    "suspend"
                ]
                is False
            ),
            timeout_s=10,
            what="the job unsuspended",
        )
        pods = both_pods(sim)
        for pod in pods:  # not queued one by one: no pod gated, none a workload of its own
            assert not pod["spec"].get("schedulingGates"), pod["metadata"]["name"]
        assert len(workloads(sim)) == 1


def test_all_or_nothing_when_the_quota_is_short(tmp_path: Path) -> None:
    """A queue with room for one pod admits none of a 2-pod job: no pod is created."""
    short = KueueSettings(ENABLED.frameworks, {QUEUE: {"pods": 1, "nvidia.com/gpu": 1}})
    with cluster(tmp_path, short) as sim:
        create(sim, training_job())
        [workload] = sim.wait_for(
            lambda: [w for w in workloads(sim) if pending_message(w)],
            timeout_s=10,
            what="the workload pending",
        )
        assert pending_message(workload) == (
            "couldn't assign flavors to pod set master: insufficient unused quota for "
            "nvidia.com/gpu in flavor default-flavor, 1 more needed, insufficient unused quota "
            "for pods in flavor default-flavor, 1 more needed"
        )
        assert admitted(sim) == []
        assert sim.fake.list_objects("pods", "default") == []
        job = sim.fake.get_object("pytorchjobs", "llm-train") or {}
        assert job["spec"]["runPolicy"]["suspend"] is True


def test_shipped_kueue_leaves_our_job_alone(tmp_path: Path) -> None:
    """Kueue as it ships (no pytorchjob integration): our job, labelled on the job only, is
    not Kueue's: no Workload, not suspended, its pods not gated (README: enable the
    integration). Before the fix its pods were each a Workload of their own."""
    with cluster(tmp_path, SHIPPED) as sim:
        created = create(sim, training_job())
        assert "suspend" not in created["spec"]["runPolicy"]
        pods = both_pods(sim)
        managed = [p["metadata"]["name"] for p in pods if MANAGED_LABEL in p["metadata"]["labels"]]
        assert managed == [], "Kueue's pod webhook took these pods one by one"
        assert [p["spec"].get("schedulingGates") for p in pods] == [None, None]
        assert workloads(sim) == []


def test_the_pod_label_variant_is_admitted_pod_by_pod(tmp_path: Path) -> None:
    """What main did: the label on the pod templates too. Under Kueue as it ships, each pod
    is gated and becomes its own 1-pod Workload; with room for one pod, one runs and the
    other waits, holding its half of the job's quota: no gang."""
    short = KueueSettings(SHIPPED.frameworks, {QUEUE: {"pods": 1, "nvidia.com/gpu": 1}})
    with cluster(tmp_path, short) as sim:
        create(sim, pod_labelled(training_job()))
        sim.wait_for(
            lambda: len(workloads(sim)) == 2 and admitted(sim),
            timeout_s=10,
            what="two pod workloads, one admitted",
        )
        wls = workloads(sim)
        assert [w["metadata"]["name"].split("-")[0] for w in wls] == ["pod", "pod"]
        assert [pod_counts(w) for w in wls] == [{"main": 1}, {"main": 1}]
        assert len(admitted(sim)) == 1
        gates = {
            p["metadata"]["name"]: [g["name"] for g in p["spec"].get("schedulingGates") or []]
            for p in sim.fake.list_objects("pods", "default")
        }
        assert sorted(gates.values()) == [[], [ADMISSION_GATE]]  # one let through, one held
        [held] = [name for name, g in gates.items() if g]
        sim.wait_for(
            lambda: scheduled_reason(sim, held) == "SchedulingGated",
            timeout_s=5,
            what=f"{held} SchedulingGated",
        )
        time.sleep(0.3)  # the scheduler never takes a gated pod (no Unschedulable write)
        assert scheduled_reason(sim, held) == "SchedulingGated"


def test_the_pod_label_variant_with_the_integration_on_is_one_workload(tmp_path: Path) -> None:
    """With the pytorchjob integration on, Kueue ignores the pods' label (their owner is
    the managed job): one Workload either way, so the label on the job alone loses nothing."""
    with cluster(tmp_path, ENABLED) as sim:
        create(sim, pod_labelled(training_job()))
        sim.wait_for(lambda: admitted(sim), timeout_s=10, what="the workload admitted")
        both_pods(sim)
        [workload] = workloads(sim)
        assert pod_counts(workload) == {"master": 1, "worker": 1}


def test_a_finished_job_frees_its_quota(tmp_path: Path) -> None:
    """The next job is admitted once the first finishes (its Workload Finished)."""
    with cluster(tmp_path, ENABLED) as sim:
        create(sim, training_job("first"))
        sim.wait_for(lambda: admitted(sim), timeout_s=10, what="first admitted")
        create(sim, training_job("second"))
        sim.wait_for(
            lambda: any(pending_message(w) for w in workloads(sim)),
            timeout_s=10,
            what="second pending",
        )
        sim.fake.patch_status(
            "pytorchjobs",
            "first",
            {
                "conditions": [
                    {"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}
                ]
            },
        )
        sim.wait_for(lambda: len(admitted(sim)) == 2, timeout_s=10, what="second admitted")
        first = next(w for w in workloads(sim) if "first" in w["metadata"]["name"])
        assert any(
            c["type"] == "Finished" and c["status"] == "True" for c in first["status"]["conditions"]
        )
