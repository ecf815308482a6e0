"""Gang scheduling of kubellm's TrainJob (trainer_backend=trainjob) through Kueue v0.19.0's
`trainer.kubeflow.org/trainjob` integration on the simulated cluster (tests/fakes/kueue.py,
trainer_v2.py, jobset.py).

The TrainJob our builder makes carries `kueue.x-k8s.io/queue-name` on its own metadata
(never on its pods), as Kueue's TrainJob integration reads it. Kueue's webhook creates it
suspended and appends its own runtime patch; the Workload is ONE, with a podSet per
replicatedJob of the JobSet Trainer would build (count = numNodes); admission writes the
podSet info into Kueue's runtime patch and unsuspends it; the TrainJob's end frees the quota.
The integration is on in the Configuration Kueue ships; without it Kueue leaves the TrainJob
alone.

The pods run a one-line command instead of the training agent (the sim's node has 2 GPUs),
so each test takes seconds.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from fakes.kueue import (
    ADMISSION_GATE,
    MANAGED_LABEL,
    PODSET_LABEL,
    QUEUE_LABEL,
    RUNTIME_PATCH_MANAGER,
    TRAINJOB,
    KueueSettings,
)
from fakes.sim_base import find_condition
from fakes.sim_cluster import SimCluster
from kubellm.backends.base import TrainJob
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.trainjob import (
    PATCH_MANAGER,
    training_runtime_manifest,
    trainjob_manifest,
)

QUEUE = "team-a"
CLUSTER = ClusterSettings(queue=QUEUE, gang_scheduler="kueue", gpus_per_node=1)
# The integrations Kueue ships (trainjob on), a ClusterQueue with room for one 2-node job...
FITS = KueueSettings(queues={QUEUE: {"pods": 2, "nvidia.com/gpu": 2}})
# ... or for one node only.
SHORT = KueueSettings(queues={QUEUE: {"pods": 1, "nvidia.com/gpu": 1}})
QUICK = "print('done')"
TRAINJOBS = ("trainer.kubeflow.org", "v1alpha1", "default", "trainjobs")


def kubellm_trainjob(name: str, code: str = QUICK) -> dict[str, Any]:
    """The 2-node TrainJob our builder makes (one GPU per node), running `code`."""
    job = TrainJob(name=name, train_args=[], nnodes=2, image="ghcr.io/kubellm/trainer:test")
    body = trainjob_manifest(job, CLUSTER)
    body["spec"]["trainer"]["command"] = ["python", "-c", code]
    body["spec"]["trainer"].pop("args", None)
    return body


def pod_labelled(body: dict[str, Any]) -> dict[str, Any]:
    """The same TrainJob with the queue label on its pods too (through our runtime patch)."""
    body = copy.deepcopy(body)
    (patch,) = body["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    rjob["template"]["spec"]["template"]["metadata"]["labels"][QUEUE_LABEL] = QUEUE
    return body


@contextmanager
def cluster(tmp_path: Path, kueue: KueueSettings) -> Iterator[SimCluster]:
    with SimCluster(tmp_path, kueue=kueue, gpus_per_node=2) as sim:
        sim.fake.create_object("clustertrainingruntimes", training_runtime_manifest(CLUSTER))
        yield sim
        assert sim.errors == [] and sim.fake.errors == [] and sim.fake.forbidden == []


def create(sim: SimCluster, body: dict[str, Any]) -> dict[str, Any]:
    api = k8s.CustomObjectsApi(sim.api_client())
    out: dict[str, Any] = api.create_namespaced_custom_object(*TRAINJOBS, body)
    return out


def trainjob(sim: SimCluster, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = sim.fake.get_object("trainjobs", name) or {}
    return obj


def workloads(sim: SimCluster) -> list[dict[str, Any]]:
    assert sim.kueue is not None
    return sim.kueue.workloads()


def workload_of(sim: SimCluster, name: str) -> dict[str, Any] | None:
    for w in workloads(sim):
        refs = w["metadata"].get("ownerReferences") or []
        if any(r["kind"] == "TrainJob" and r["name"] == name for r in refs):
            return w
    return None


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    return find_condition((obj or {}).get("status") or {}, ctype) or {}


def pods_of(sim: SimCluster, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in sim.fake.list_objects("pods", "default")
        if p["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name
    ]


def _true(sim: SimCluster, read: Any, ctype: str, timeout_s: float, what: str) -> dict[str, Any]:
    """`read()` once its `ctype` condition is True."""
    return sim.wait_for(
        lambda: condition(read(), ctype).get("status") == "True" and read(), timeout_s, what
    )


def complete(sim: SimCluster, name: str, timeout_s: float = 30) -> dict[str, Any]:
    return _true(
        sim, lambda: trainjob(sim, name), "Complete", timeout_s, f"TrainJob {name} Complete"
    )


def finished(sim: SimCluster, name: str, timeout_s: float = 10) -> dict[str, Any]:
    """TrainJob `name`'s Workload once Kueue has finished it: its reconcile follows the
    TrainJob's Complete condition, not within the same update."""
    what = f"TrainJob {name}'s Workload Finished"
    return _true(sim, lambda: workload_of(sim, name), "Finished", timeout_s, what)


def kueue_patch(tj: dict[str, Any]) -> dict[str, Any]:
    (patch,) = [p for p in tj["spec"]["runtimePatches"] if p["manager"] == RUNTIME_PATCH_MANAGER]
    return dict(patch)


def test_the_queue_label_is_on_the_trainjob_not_on_its_pods() -> None:
    """Kueue's TrainJob integration reads the label on the TrainJob's metadata (reconciler.go
    L363-L367); on the pods (our runtime patch) the `pod` integration would take them one by
    one. Our builder leaves spec.suspend to Kueue's webhook."""
    body = kubellm_trainjob("llm-train")
    assert body["metadata"]["labels"][QUEUE_LABEL] == QUEUE
    assert "suspend" not in body["spec"]
    (patch,) = body["spec"]["runtimePatches"]
    assert patch["manager"] == PATCH_MANAGER != RUNTIME_PATCH_MANAGER
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    labels = rjob["template"]["spec"]["template"]["metadata"]["labels"]
    assert QUEUE_LABEL not in labels
    assert labels["app.kubernetes.io/managed-by"] == "kubellm"


def test_a_trainjob_that_fits_is_one_workload_admitted_whole_and_runs(tmp_path: Path) -> None:
    with cluster(tmp_path, FITS) as sim:
        create(sim, kubellm_trainjob("llm-train"))
        # the webhook (the object as stored, before any controller saw it): suspended,
        # Kueue's runtime patch appended after ours
        created = next(
            e.obj for e in sim.fake.history("trainjobs") if len(e.obj["spec"]["runtimePatches"]) > 1
        )
        assert created["spec"]["suspend"] is True
        managers = [p["manager"] for p in created["spec"]["runtimePatches"]]
        assert managers == [PATCH_MANAGER, RUNTIME_PATCH_MANAGER]
        assert not (created["spec"]["runtimePatches"][1]["trainingRuntimeSpec"]["template"]["spec"])

        done = complete(sim, "llm-train")
        finished(sim, "llm-train")
        (workload,) = workloads(sim)  # the JobSet, its Job and pods are no Workloads
        name = workload["metadata"]["name"]
        assert (
            name.startswith("trainjob-llm-train-") and len(name) == len("trainjob-llm-train-") + 5
        )
        assert workload["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
        assert workload["spec"]["queueName"] == QUEUE
        assert [(ps["name"], ps["count"]) for ps in workload["spec"]["podSets"]] == [("node", 2)]
        (assignment,) = workload["status"]["admission"]["podSetAssignments"]
        assert assignment["resourceUsage"] == {"nvidia.com/gpu": "2", "pods": "2"}
        assert condition(workload, "Admitted")["status"] == "True"
        assert condition(workload, "Finished")["status"] == "True"

        # admission: the podSet info in Kueue's patch, ours untouched, then unsuspended
        assert done["spec"]["suspend"] is False
        (rjob,) = kueue_patch(done)["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        assert rjob["name"] == "node"
        assert rjob["template"]["spec"]["template"]["metadata"]["labels"] == {PODSET_LABEL: "node"}
        assert (
            done["spec"]["runtimePatches"][0]
            == kubellm_trainjob("llm-train")["spec"]["runtimePatches"][0]
        )
        pods = pods_of(sim, "llm-train")
        assert len(pods) == 2
        for pod in pods:
            assert pod["metadata"]["labels"][PODSET_LABEL] == "node"
            assert MANAGED_LABEL not in pod["metadata"]["labels"]  # not the pod integration's
            assert not pod["spec"].get("schedulingGates")
            assert pod["status"]["phase"] == "Succeeded"


def test_a_trainjob_that_does_not_fit_stays_suspended_without_pods(tmp_path: Path) -> None:
    with cluster(tmp_path, SHORT) as sim:
        create(sim, kubellm_trainjob("llm-train"))
        pending = sim.wait_for(
            lambda: condition(workload_of(sim, "llm-train"), "QuotaReserved"),
            10,
            "QuotaReserved False",
        )
        assert (pending["status"], pending["reason"]) == ("False", "Pending")
        assert pending["message"] == (
            "couldn't assign flavors to pod set node: insufficient unused quota for "
            "nvidia.com/gpu in flavor default-flavor, 1 more needed, insufficient unused "
            "quota for pods in flavor default-flavor, 1 more needed"
        )
        sim.wait_for(
            lambda: condition(trainjob(sim, "llm-train"), "Suspended").get("status") == "True",
            10,
            "Suspended",
        )
        time.sleep(1.0)  # time enough for a JobSet to start Jobs and pods, were it running
        tj = trainjob(sim, "llm-train")
        assert tj["spec"]["suspend"] is True
        assert "replicatedJobs" not in kueue_patch(tj)["trainingRuntimeSpec"]["template"]["spec"]
        jobset = sim.fake.get_object("jobsets", "llm-train")
        assert jobset is not None and jobset["spec"]["suspend"] is True
        jobs = sim.fake.list_objects("jobs", "default")  # JobSet makes its Jobs suspended
        assert [j["spec"]["suspend"] for j in jobs] == [True]
        assert pods_of(sim, "llm-train") == []
        (workload,) = workloads(sim)
        assert condition(workload, "Admitted") == {}


def test_a_queued_trainjob_unsuspended_by_hand_is_suspended_again(tmp_path: Path) -> None:
    """A TrainJob running without an admitted Workload is stopped: suspended again."""
    with cluster(tmp_path, SHORT) as sim:
        create(sim, kubellm_trainjob("llm-train"))
        sim.wait_for(
            lambda: condition(workload_of(sim, "llm-train"), "QuotaReserved"), 10, "pending"
        )
        with sim.fake._lock:  # `kubectl patch trainjob llm-train -p '{"spec":{"suspend":false}}'`
            tj = trainjob(sim, "llm-train")
            tj["spec"]["suspend"] = False
            sim.fake.put_object("trainjobs", tj)
        sim.wait_for(
            lambda: (
                any(e.obj["spec"].get("suspend") is False for e in sim.fake.history("trainjobs"))
                and trainjob(sim, "llm-train")["spec"]["suspend"] is True
            ),
            10,
            "suspended again",
        )
        assert sim.kueue is not None
        assert not sim.kueue.admitted(workload_of(sim, "llm-train") or {})


def test_without_the_trainjob_integration_kueue_leaves_the_trainjob_alone(
    tmp_path: Path,
) -> None:
    """The label on the TrainJob alone is read by no other integration: not suspended, no
    Kueue runtime patch, no Workload, its pods run outside the queue's quota."""
    with cluster(tmp_path, SHORT.without(TRAINJOB)) as sim:
        create(sim, kubellm_trainjob("llm-train"))
        tj = trainjob(sim, "llm-train")
        assert not tj["spec"].get("suspend")
        assert [p["manager"] for p in tj["spec"]["runtimePatches"]] == [PATCH_MANAGER]
        complete(sim, "llm-train")
        assert workloads(sim) == []
        assert len(pods_of(sim, "llm-train")) == 2  # 2 pods, with quota for 1


def test_without_the_integration_pod_labels_are_admitted_pod_by_pod(tmp_path: Path) -> None:
    """With the label on the pods as well, the `pod` integration makes each pod its own
    Workload: one node runs while the other waits, gated, for the quota it holds."""
    with cluster(tmp_path, SHORT.without(TRAINJOB)) as sim:
        create(sim, pod_labelled(kubellm_trainjob("llm-train", "import time; time.sleep(1)")))

        def half_admitted() -> list[dict[str, Any]] | None:
            pods = pods_of(sim, "llm-train")
            ws = workloads(sim)
            if len(pods) != 2 or len(ws) != 2:
                return None
            # The second pod's Workload exists before the scheduler has looked at it: wait
            # for its pending condition too, not only for the first one's admission.
            admitted = [condition(w, "Admitted").get("status") for w in ws]
            reserved = condition(ws[1], "QuotaReserved").get("status")
            return ws if admitted == ["True", None] and reserved == "False" else None

        ws = sim.wait_for(half_admitted, 10, "one pod admitted, the other pending on quota")
        for w in ws:
            assert w["metadata"]["name"].startswith("pod-llm-train-node-0-")
            assert [(ps["name"], ps["count"]) for ps in w["spec"]["podSets"]] == [("main", 1)]
        assert "insufficient unused quota for pods" in condition(ws[1], "QuotaReserved")["message"]
        waiting = sim.fake.get_object("pods", ws[1]["metadata"]["ownerReferences"][0]["name"])
        assert waiting is not None and waiting["metadata"]["labels"][MANAGED_LABEL] == "true"
        assert {"name": ADMISSION_GATE} in waiting["spec"]["schedulingGates"]
        complete(sim, "llm-train")  # the first pod's end frees the quota for the second


def test_with_the_integration_pod_labels_are_not_gated(tmp_path: Path) -> None:
    """The pods' managed ancestor is the TrainJob (pod -> Job -> JobSet -> TrainJob): the pod
    webhook leaves them alone and the TrainJob is still one Workload."""
    with cluster(tmp_path, FITS) as sim:
        create(sim, pod_labelled(kubellm_trainjob("llm-train")))
        complete(sim, "llm-train")
        (workload,) = workloads(sim)
        assert workload["metadata"]["name"].startswith("trainjob-llm-train-")
        for pod in pods_of(sim, "llm-train"):
            assert MANAGED_LABEL not in pod["metadata"]["labels"]
            assert not pod["spec"].get("schedulingGates")


def test_two_trainjobs_competing_for_the_quota_run_one_after_the_other(tmp_path: Path) -> None:
    with cluster(tmp_path, FITS) as sim:
        create(sim, kubellm_trainjob("first", "import time; time.sleep(1)"))
        sim.wait_for(lambda: workload_of(sim, "first"), 10, "first's Workload")
        create(sim, kubellm_trainjob("second"))
        pending = sim.wait_for(
            lambda: (
                condition(workload_of(sim, "second"), "QuotaReserved").get("status") == "False"
                and condition(workload_of(sim, "second"), "QuotaReserved")
            ),
            10,
            "second pending",
        )
        assert pending["reason"] == "Pending"
        assert condition(workload_of(sim, "first"), "Admitted")["status"] == "True"
        assert trainjob(sim, "second")["spec"]["suspend"] is True

        deadline = time.monotonic() + 30
        while True:  # pods read before first's state: none of second's while first runs
            seconds_pods = pods_of(sim, "second")
            if condition(trainjob(sim, "first"), "Complete").get("status") == "True":
                break
            assert seconds_pods == [], "second's pods created while first runs"
            assert time.monotonic() < deadline, "first not Complete within 30s"
            time.sleep(0.02)
        finished(sim, "first")
        complete(sim, "second")
        second = finished(sim, "second")
        assert condition(second, "Admitted")["status"] == "True"
        assert condition(second, "Finished")["status"] == "True"
