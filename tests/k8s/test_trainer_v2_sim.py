"""The simulated cluster's Trainer v2 (trainer_v2.py) and JobSet (jobset.py) controllers:
a TrainJob on a ClusterTrainingRuntime shaped like upstream's torch_distributed.yaml becomes a
JobSet, Indexed Jobs and pods with the torch plugin's env, driven through the real client.

Every test ends with no controller error and no schema error (the `sim` fixture checks).
RBAC is off: the repo's Role does not grant TrainJobs yet (the TrainJob backend's work).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from fakes.fake_k8s import ApiError
from fakes.sim_cluster import SimCluster

TRAINJOBS = ("trainer.kubeflow.org", "v1alpha1", "default", "trainjobs")
PRINT_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith('PET_') or k in ('JOB_COMPLETION_INDEX', 'MY_VAR')}))"
)


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimCluster]:
    with SimCluster(tmp_path, rbac=None) as cluster:
        yield cluster
        assert cluster.errors == []
        assert cluster.fake.errors == []


def runtime(
    name: str = "torch-distributed",
    failure_policy: dict[str, Any] | None = None,
    pod_failure_policy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """manifests/base/runtimes/torch_distributed.yaml at v2.3.0, plus what a test needs."""
    job_spec: dict[str, Any] = {
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "node",
                        "image": "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime",
                    }
                ]
            }
        }
    }
    spec: dict[str, Any] = {
        "replicatedJobs": [
            {
                "name": "node",
                "template": {
                    "metadata": {
                        "labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
                    },
                    "spec": job_spec,
                },
            }
        ]
    }
    if failure_policy is not None:
        spec["failurePolicy"] = failure_policy
        job_spec["backoffLimit"] = 0
        job_spec["template"]["spec"]["restartPolicy"] = "Never"
    if pod_failure_policy is not None:
        job_spec["podFailurePolicy"] = pod_failure_policy
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": spec},
        },
    }


def trainjob(
    name: str, code: str, nodes: int = 2, runtime_name: str = "torch-distributed", **spec: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": runtime_name},
            "trainer": {
                "numNodes": nodes,
                "command": ["python", "-c", code],
                "env": [{"name": "MY_VAR", "value": "x"}],
            },
            **spec,
        },
    }


def api(sim: SimCluster) -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(sim.api_client())


def cond(sim: SimCluster, plural: str, name: str, ctype: str) -> dict[str, Any] | None:
    obj = sim.fake.get_object(plural, name) or {}
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype and c["status"] == "True":
            return dict(c)
    return None


def pods_of(sim: SimCluster, tj: str) -> list[dict[str, Any]]:
    return [
        p
        for p in sim.fake.list_objects("pods", "default")
        if p["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == tj
    ]


def test_two_nodes_get_the_torch_env_and_the_trainjob_completes(sim: SimCluster) -> None:
    sim.fake.create_object("clustertrainingruntimes", runtime())
    api(sim).create_namespaced_custom_object(*TRAINJOBS, trainjob("tj", PRINT_ENV))
    done = sim.wait_for(lambda: cond(sim, "trainjobs", "tj", "Complete"), 30, "Complete")
    assert (done["reason"], done["message"]) == (
        "AllJobsCompleted",
        "jobset completed successfully",
    )

    js = sim.fake.get_object("jobsets", "tj")
    assert js["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
    assert js["metadata"]["ownerReferences"][0]["controller"] is True
    job = sim.fake.get_object("jobs", "tj-node-0")
    assert (job["spec"]["parallelism"], job["spec"]["completions"]) == (2, 2)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "0"
    pods = sorted(pods_of(sim, "tj"), key=lambda p: p["metadata"]["name"])
    assert [p["metadata"]["name"][: len("tj-node-0-0-")] for p in pods] == [
        "tj-node-0-0-",
        "tj-node-0-1-",
    ]
    assert [p["spec"]["hostname"] for p in pods] == ["tj-node-0-0", "tj-node-0-1"]
    assert {p["spec"]["subdomain"] for p in pods} == {"tj"}
    envs = [json.loads(sim.fake.pod_log("default", p["metadata"]["name"])) for p in pods]
    port = envs[0]["PET_MASTER_PORT"]
    assert port.isdigit() and port != "29500"
    for rank, env in enumerate(envs):
        assert env == {
            "MY_VAR": "x",
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": port,
            "JOB_COMPLETION_INDEX": str(rank),
        }
    status = sim.fake.get_object("trainjobs", "tj")["status"]
    assert status["jobsStatus"] == [
        {"name": "node", "ready": 0, "succeeded": 1, "failed": 0, "active": 0, "suspended": 0}
    ]


def test_a_failing_node_restarts_the_jobset_up_to_max_restarts_then_fails(
    sim: SimCluster,
) -> None:
    sim.fake.create_object("clustertrainingruntimes", runtime(failure_policy={"maxRestarts": 1}))
    code = "import os, sys; sys.exit(3 if os.environ['PET_NODE_RANK'] == '1' else 0)"
    api(sim).create_namespaced_custom_object(*TRAINJOBS, trainjob("bad", code))
    failed = sim.wait_for(lambda: cond(sim, "trainjobs", "bad", "Failed"), 30, "Failed")
    assert failed["reason"] == "ReachedMaxRestarts"
    assert failed["message"] == (
        "jobset failed due to reaching max number of restarts (first failed job: bad-node-0)"
    )
    js = sim.fake.get_object("jobsets", "bad")
    assert (js["status"]["restarts"], js["status"]["restartsCountTowardsMax"]) == (1, 1)
    conds = {c["type"]: c for c in js["status"]["conditions"]}
    assert (conds["Restarting"]["status"], conds["Restarting"]["reason"]) == (
        "False",
        "JobSetFailed",
    )
    assert js["status"]["terminalState"] == "Failed"
    restarted = [
        c
        for e in sim.fake.history("jobsets")
        for c in (e.obj.get("status") or {}).get("conditions") or []
        if c["type"] == "Restarting" and c["status"] == "True"
    ]
    assert restarted[0]["reason"] == "DefaultFailurePolicy"
    assert restarted[0]["message"] == (
        "applying RestartJobSet failure policy action (first failed job: bad-node-0)"
    )
    attempts = sorted(
        {
            e.obj["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"]
            for e in sim.fake.history("jobs")
            if e.type == "ADDED"
        }
    )
    assert attempts == ["0", "1"]
    job = sim.fake.get_object("jobs", "bad-node-0")
    assert cond(sim, "jobs", "bad-node-0", "Failed")["reason"] == "BackoffLimitExceeded"
    assert job["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "1"
    assert cond(sim, "trainjobs", "bad", "Complete") is None


# What manifests/cluster/trainer-v2's runtime sets: the agent's permanent exits fail the Job
# by its pod failure policy, and a rule on that reason fails the JobSet without a restart.
PERMANENT = {
    "rules": [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "node", "operator": "In", "values": [1, 2, 3, 4]},
        }
    ]
}
FAIL_ON_PERMANENT = {
    "maxRestarts": 3,
    "rules": [
        {
            "name": "permanent-exit",
            "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"],
        }
    ],
}


def test_a_permanent_exit_fails_the_job_by_pod_failure_policy_and_the_jobset_at_once(
    sim: SimCluster,
) -> None:
    sim.fake.create_object(
        "clustertrainingruntimes",
        runtime(failure_policy=FAIL_ON_PERMANENT, pod_failure_policy=PERMANENT),
    )
    code = "import os, sys; sys.exit(3 if os.environ['PET_NODE_RANK'] == '1' else 0)"
    api(sim).create_namespaced_custom_object(*TRAINJOBS, trainjob("perm", code))
    failed = sim.wait_for(lambda: cond(sim, "trainjobs", "perm", "Failed"), 30, "Failed")
    assert failed["reason"] == "FailJobSetFailurePolicyAction"
    assert failed["message"] == (
        "applying FailJobSet failure policy action (first failed job: perm-node-0)"
    )
    job = cond(sim, "jobs", "perm-node-0", "Failed")
    assert job is not None and job["reason"] == "PodFailurePolicy"
    (rank1,) = [
        p["metadata"]["name"]
        for p in pods_of(sim, "perm")
        if p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == "1"
    ]
    assert job["message"] == (
        f"Container node for pod default/{rank1} failed with exit code 3 matching FailJob "
        "rule at index 0"
    )
    js = sim.fake.get_object("jobsets", "perm")
    assert js["status"].get("restarts", 0) == 0  # no restart for a permanent exit


def test_a_retryable_exit_matches_no_rule_and_restarts_the_jobset(sim: SimCluster) -> None:
    sim.fake.create_object(
        "clustertrainingruntimes",
        runtime(failure_policy=FAIL_ON_PERMANENT, pod_failure_policy=PERMANENT),
    )
    # exit 200 (the agent after a pre-emption checkpoint) is not in the FailJob list: the
    # Job fails by backoffLimit 0, no rule matches that reason, the default RestartJobSet
    marker = sim.tmp_path / "once"
    code = (
        f"import os, pathlib, sys; m = pathlib.Path({str(marker)!r})\n"
        "if os.environ['PET_NODE_RANK'] == '1' and not m.exists(): m.touch(); sys.exit(200)"
    )
    api(sim).create_namespaced_custom_object(*TRAINJOBS, trainjob("retry", code))
    sim.wait_for(lambda: cond(sim, "trainjobs", "retry", "Complete"), 30, "Complete")
    js = sim.fake.get_object("jobsets", "retry")
    assert js["status"]["restarts"] == 1
    restarted = [
        c
        for e in sim.fake.history("jobsets")
        for c in (e.obj.get("status") or {}).get("conditions") or []
        if c["type"] == "Restarting" and c["status"] == "True"
    ]
    assert restarted[0]["reason"] == "DefaultFailurePolicy"


def test_active_deadline_fails_the_trainjob_and_deletes_its_jobset(sim: SimCluster) -> None:
    sim.fake.create_object("clustertrainingruntimes", runtime())
    body = trainjob("slow", "import time; time.sleep(120)", activeDeadlineSeconds=2)
    api(sim).create_namespaced_custom_object(*TRAINJOBS, body)
    sim.wait_for(lambda: sim.fake.get_object("jobsets", "slow"), 10, "the JobSet")
    failed = sim.wait_for(lambda: cond(sim, "trainjobs", "slow", "Failed"), 30, "Failed")
    assert (failed["reason"], failed["message"]) == (
        "DeadlineExceeded",
        "TrainJob exceeded its active deadline",
    )
    sim.wait_for(lambda: sim.fake.get_object("jobsets", "slow") is None, 10, "JobSet gone")
    sim.wait_for(lambda: not pods_of(sim, "slow"), 20, "pods gone")


def test_a_trainjob_whose_runtime_does_not_exist_is_refused(sim: SimCluster) -> None:
    with pytest.raises(k8s.ApiException) as err:
        api(sim).create_namespaced_custom_object(
            *TRAINJOBS, trainjob("orphan", "pass", runtime_name="nope")
        )
    assert err.value.status == 403
    message = json.loads(err.value.body)["message"]
    assert message.startswith(
        'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: '
        "spec.RuntimeRef: Invalid value: "
    )
    assert message.endswith(
        'clustertrainingruntimes.trainer.kubeflow.org "nope" not found: specified '
        "clusterTrainingRuntime must be created before the TrainJob is created"
    )
    assert sim.fake.get_object("trainjobs", "orphan") is None
    assert sim.fake.list_objects("jobsets") == []


def test_suspend_holds_the_pods_and_resume_runs_them(sim: SimCluster) -> None:
    sim.fake.create_object("clustertrainingruntimes", runtime())
    api(sim).create_namespaced_custom_object(*TRAINJOBS, trainjob("held", "pass", suspend=True))
    susp = sim.wait_for(lambda: cond(sim, "trainjobs", "held", "Suspended"), 10, "Suspended")
    assert (susp["reason"], susp["message"]) == ("Suspended", "TrainJob is suspended")
    sim.wait_for(lambda: sim.fake.get_object("jobs", "held-node-0"), 10, "the Job")
    assert sim.fake.get_object("jobsets", "held")["spec"]["suspend"] is True
    assert sim.fake.get_object("jobs", "held-node-0")["spec"]["suspend"] is True
    assert pods_of(sim, "held") == []

    api(sim).patch_namespaced_custom_object(*TRAINJOBS, "held", {"spec": {"suspend": False}})
    sim.wait_for(lambda: cond(sim, "trainjobs", "held", "Complete"), 30, "Complete")
    tj = sim.fake.get_object("trainjobs", "held")
    resumed = [c for c in tj["status"]["conditions"] if c["type"] == "Suspended"]
    assert [(c["status"], c["reason"], c["message"]) for c in resumed] == [
        ("False", "Resumed", "TrainJob is resumed")
    ]
    assert len(pods_of(sim, "held")) == 2


def test_deleting_the_trainjob_deletes_its_jobset_jobs_and_pods(sim: SimCluster) -> None:
    sim.fake.create_object("clustertrainingruntimes", runtime())
    api(sim).create_namespaced_custom_object(
        *TRAINJOBS, trainjob("gone", "import time; time.sleep(60)")
    )
    sim.wait_for(
        lambda: [p for p in pods_of(sim, "gone") if p["status"].get("phase") == "Running"],
        20,
        "running pods",
    )
    assert sim.fake.get_object("jobs", "gone-node-0") is not None
    api(sim).delete_namespaced_custom_object(*TRAINJOBS, "gone")
    sim.wait_for(
        lambda: (
            sim.fake.get_object("jobsets", "gone") is None
            and sim.fake.get_object("jobs", "gone-node-0") is None
            and pods_of(sim, "gone") == []
        ),
        5,
        "the cascade",
    )
    deleted = {(plural, name) for plural, _, name in sim.fake.deleted}
    assert {("trainjobs", "gone"), ("jobsets", "gone"), ("jobs", "gone-node-0")} <= deleted


def test_a_runtime_gone_after_admission_leaves_the_trainjob_without_a_jobset(
    sim: SimCluster,
) -> None:
    # Stored as if admitted while its runtime existed: NewObjects then fails (an event only).
    sim.fake.put_object("trainjobs", {**trainjob("late", "pass"), "metadata": {"name": "late"}})
    time.sleep(1.5)  # the controller retries every second
    assert sim.fake.get_object("jobsets", "late") is None
    assert (sim.fake.get_object("trainjobs", "late").get("status") or {}).get("conditions") in (
        None,
        [],
    )
    sim.fake.create_object("clustertrainingruntimes", runtime())
    sim.wait_for(lambda: cond(sim, "trainjobs", "late", "Complete"), 30, "Complete once it exists")


def test_a_restarted_jobset_that_then_succeeds_reports_ready_then_completed(
    sim: SimCluster, tmp_path: Path
) -> None:
    sim.fake.create_object("clustertrainingruntimes", runtime(failure_policy={"maxRestarts": 2}))
    marker = tmp_path / "failed-once"
    code = (
        "import os, sys, time\n"
        f"m = {str(marker)!r} + os.environ['PET_NODE_RANK']\n"
        "if not os.path.exists(m):\n"
        "    open(m, 'w').close(); sys.exit(1)\n"
        "time.sleep(1.5)\n"
    )
    api(sim).create_namespaced_custom_object(*TRAINJOBS, trainjob("again", code))
    sim.wait_for(lambda: cond(sim, "trainjobs", "again", "Complete"), 30, "Complete")
    js = sim.fake.get_object("jobsets", "again")
    assert js["status"]["restarts"] == 1
    assert js["status"]["terminalState"] == "Completed"
    restarting = [
        (c["status"], c["reason"])
        for e in sim.fake.history("jobsets")
        for c in (e.obj.get("status") or {}).get("conditions") or []
        if c["type"] == "Restarting"
    ]
    assert ("True", "DefaultFailurePolicy") in restarting
    assert ("False", "JobsReady") in restarting
    assert restarting[-1] == ("False", "JobSetCompleted")
    assert cond(sim, "trainjobs", "again", "Failed") is None


def test_cluster_training_runtimes_are_cluster_scoped(sim: SimCluster) -> None:
    objs = api(sim)
    group, version = "trainer.kubeflow.org", "v1alpha1"
    objs.create_cluster_custom_object(group, version, "clustertrainingruntimes", runtime("ctr"))
    got = objs.get_cluster_custom_object(group, version, "clustertrainingruntimes", "ctr")
    assert got["metadata"]["name"] == "ctr" and "namespace" not in got["metadata"]
    listed = objs.list_cluster_custom_object(group, version, "clustertrainingruntimes")
    assert [o["metadata"]["name"] for o in listed["items"]] == ["ctr"]
    with pytest.raises(k8s.ApiException) as err:
        objs.get_namespaced_custom_object(
            group, version, "default", "clustertrainingruntimes", "ctr"
        )
    assert err.value.status == 404
    bad = runtime("bad")
    bad["spec"]["mlPolicy"]["nodes"] = 2  # not a field of MLPolicy
    with pytest.raises(k8s.ApiException) as err:
        objs.create_cluster_custom_object(group, version, "clustertrainingruntimes", bad)
    assert err.value.status == 422
    assert "spec.mlPolicy.nodes: unknown field" in json.loads(err.value.body)["message"]
    sim.fake.errors.clear()  # the refusal above is the point of the test


def test_runtime_patches_are_merged_into_the_jobset_before_the_trainer_fields(
    sim: SimCluster,
) -> None:
    sim.fake.create_object("clustertrainingruntimes", runtime())
    patch = {
        "manager": "kueue.x-k8s.io/manager",
        "trainingRuntimeSpec": {
            "template": {
                "metadata": {"labels": {"patched": "yes"}},
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "spec": {
                                    "template": {
                                        "spec": {
                                            "nodeSelector": {"pool": "a"},
                                            "containers": [
                                                {
                                                    "name": "node",
                                                    "securityContext": {
                                                        "allowPrivilegeEscalation": False
                                                    },
                                                }
                                            ],
                                        }
                                    }
                                }
                            },
                        }
                    ]
                },
            }
        },
    }
    body = trainjob("patched", "pass", nodes=1, runtimePatches=[patch])
    api(sim).create_namespaced_custom_object(*TRAINJOBS, body)
    sim.wait_for(lambda: cond(sim, "trainjobs", "patched", "Complete"), 30, "Complete")
    js = sim.fake.get_object("jobsets", "patched")
    assert js["metadata"]["labels"] == {"patched": "yes"}
    pod_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"pool": "a"}
    (node,) = pod_spec["containers"]
    assert node["image"] == "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime"
    assert node["securityContext"] == {"allowPrivilegeEscalation": False}
    names = [e["name"] for e in node["env"]]
    assert names[:2] == ["MY_VAR", "PET_NNODES"]  # the trainer env, then the torch plugin's


def test_the_webhooks_refuse_what_trainer_v2_refuses(sim: SimCluster) -> None:
    bad_runtime = runtime("two-replicas")
    bad_runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["replicas"] = 2
    with pytest.raises(ApiError) as err:
        sim.fake.create_object("clustertrainingruntimes", bad_runtime)
    assert err.value.code == 403
    assert (
        'admission webhook "validator.clustertrainingruntime.trainer.kubeflow.org" denied the '
        "request: spec.template.spec.replicatedJobs[0].replicas: Invalid value: 2: always "
        "must be 1"
    ) in str(err.value)
    sim.fake.create_object("clustertrainingruntimes", runtime())
    reserved = trainjob("reserved", "pass")
    reserved["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "9"})
    with pytest.raises(k8s.ApiException) as api_err:
        api(sim).create_namespaced_custom_object(*TRAINJOBS, reserved)
    assert api_err.value.status == 403
    assert "must not have reserved envs, invalid envs configured: [PET_NNODES]" in str(
        api_err.value.body
    )
    patched = trainjob("env-patch", "pass")
    node_patch = {"name": "node", "env": [{"name": "A", "value": "1"}]}
    pod = {"spec": {"template": {"spec": {"containers": [node_patch]}}}}
    template = {"spec": {"replicatedJobs": [{"name": "node", "template": pod}]}}
    patched["spec"]["runtimePatches"] = [
        {"manager": "example.com/x", "trainingRuntimeSpec": {"template": template}}
    ]
    with pytest.raises(k8s.ApiException) as api_err:
        api(sim).create_namespaced_custom_object(*TRAINJOBS, patched)
    assert "must not have envs for the dataset-initializer, model-initializer, node" in str(
        api_err.value.body
    )
    with pytest.raises(k8s.ApiException) as api_err:
        api(sim).create_namespaced_custom_object(*TRAINJOBS, trainjob("9-digit-first", "pass"))
    assert api_err.value.status == 422
    assert "metadata.name must match RFC 1035 DNS label format" in str(api_err.value.body)
    assert sim.fake.list_objects("trainjobs") == []
