"""The simulated cluster: each controller behaves as the real one does, driven through the
real kubernetes client (RBAC on: the repo's Role), pods running as local processes.

Every test ends with no controller error and no schema error (the `sim` fixture checks):
what the simulated controllers write must be what the real ones could write.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch

from fakes.fake_k8s import ApiError
from fakes.sim_cluster import SimCluster

JOBS = ("kubeflow.org", "v1", "default", "pytorchjobs")
EXPERIMENTS = ("kubeflow.org", "v1beta1", "default", "experiments")
ISVCS = ("serving.kserve.io", "v1beta1", "default", "inferenceservices")
MODEL_SERVER = Path(__file__).parents[1] / "fakes" / "model_server.py"


# `sim`: tests/k8s/conftest.py (the repo's Role; no errors, nothing forbidden)


def container(code: str, **extra: Any) -> dict[str, Any]:
    return {"name": "pytorch", "image": "img", "command": ["python", "-c", code], **extra}


def pytorchjob(
    name: str,
    code: str,
    workers: int = 0,
    restart: str = "ExitCode",
    run_policy: dict[str, Any] | None = None,
    **container_extra: Any,
) -> dict[str, Any]:
    def replica(n: int) -> dict[str, Any]:
        return {
            "replicas": n,
            "restartPolicy": restart,
            "template": {"spec": {"containers": [container(code, **container_extra)]}},
        }

    specs = {"Master": replica(1)}
    if workers:
        specs["Worker"] = replica(workers)
    spec: dict[str, Any] = {"pytorchReplicaSpecs": specs}
    if run_policy:
        spec["runPolicy"] = run_policy
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


def pod_names(sim: SimCluster, selector: str = "") -> list[str]:
    core = k8s.CoreV1Api(sim.api_client())
    return [
        p.metadata.name for p in core.list_namespaced_pod("default", label_selector=selector).items
    ]


# ---------------------------------------------------------------- Training Operator

GLOO = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist

    print(" ".join(f"{k}={os.environ[k]}" for k in sorted(os.environ) if k.startswith("PET_")))
    dist.init_process_group(
        "gloo", rank=int(os.environ["PET_NODE_RANK"]), world_size=int(os.environ["PET_NNODES"])
    )
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank={dist.get_rank()} allreduce={t.item()}", flush=True)
    dist.destroy_process_group()
    """
)


def test_two_replica_job_rendezvous_over_gloo_and_succeeds(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    rv = api.list_namespaced_custom_object(*JOBS)["metadata"]["resourceVersion"]
    api.create_namespaced_custom_object(*JOBS, pytorchjob("ddp", GLOO, workers=1))

    stream = watch.Watch().stream(
        api.list_namespaced_custom_object,
        *JOBS,
        field_selector="metadata.name=ddp",
        resource_version=rv,
        timeout_seconds=60,
    )
    seen = []
    for event in stream:
        conds = [c["type"] for c in (event["raw_object"].get("status") or {}).get("conditions", [])]
        seen.append(conds)
        if "Succeeded" in conds or "Failed" in conds:
            break
    job = api.get_namespaced_custom_object(*JOBS, "ddp")
    assert condition(job, "Succeeded")["reason"] == "PyTorchJobSucceeded", job["status"]
    assert condition(job, "Succeeded")["message"] == "PyTorchJob ddp is successfully completed."
    assert condition(job, "Running")["status"] == "False"
    assert ["Created", "Running"] in seen  # as the operator writes them, one by one
    assert job["status"]["replicaStatuses"]["Master"]["succeeded"] == 1
    assert job["status"]["startTime"] and job["status"]["completionTime"]

    core = k8s.CoreV1Api(sim.api_client())
    master = core.read_namespaced_pod("ddp-master-0", "default")
    assert master.metadata.labels == {
        "training.kubeflow.org/operator-name": "pytorchjob-controller",
        "training.kubeflow.org/job-name": "ddp",
        "training.kubeflow.org/replica-type": "master",
        "training.kubeflow.org/replica-index": "0",
        "training.kubeflow.org/job-role": "master",
    }
    (ref,) = master.metadata.owner_references
    assert (ref.kind, ref.name, ref.controller) == ("PyTorchJob", "ddp", True)
    assert master.spec.restart_policy == "Never"  # ExitCode is the operator's, not the pod's
    assert master.status.container_statuses[0].state.terminated.exit_code == 0
    logs = {
        name: core.read_namespaced_pod_log(name, "default", _preload_content=False).data.decode()
        for name in ("ddp-master-0", "ddp-worker-0")
    }
    for rank, name in enumerate(logs):
        assert f"PET_NNODES=2 PET_NODE_RANK={rank} PET_NPROC_PER_NODE=auto" in logs[name]
        assert f"rank={rank} allreduce=3.0" in logs[name]
    env = {e.name: e.value for e in master.spec.containers[0].env}
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "127.0.0.1"
    assert env["WORLD_SIZE"] == "2" and env["RANK"] == "0" and env["PYTHONUNBUFFERED"] == "1"


def test_permanent_exit_code_fails_the_job_naming_the_replica(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    api.create_namespaced_custom_object(
        *JOBS, pytorchjob("bad", "import sys; print('boom'); sys.exit(1)")
    )
    sim.wait_for(lambda: sim.condition("pytorchjobs", "bad", "Failed"), what="bad Failed")
    failed = condition(sim.fake.get_object("pytorchjobs", "bad"), "Failed")
    assert failed["reason"] == "PyTorchJobFailed"
    assert failed["message"] == 'job "bad" is failing because "Master" replica(s) failed.'
    core = k8s.CoreV1Api(sim.api_client())
    pod = core.read_namespaced_pod("bad-master-0", "default")  # cleanPodPolicy None keeps it
    assert pod.status.phase == "Failed"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 1
    assert core.read_namespaced_pod_log("bad-master-0", "default") == "boom\n"


def pods_created(sim: SimCluster, rv: str) -> list[str]:
    """The uids of the pods created since resourceVersion `rv`, from a watch."""
    core = k8s.CoreV1Api(sim.api_client())
    events = watch.Watch().stream(
        core.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=1
    )
    return [e["object"].metadata.uid for e in events if e["type"] == "ADDED"]


def test_retryable_exit_code_is_retried_past_the_backoff_limit(sim: SimCluster) -> None:
    """release-1.9 recreates a pod that exits 128-255 under ExitCode with restartPolicy
    Never, and its backoffLimit counts only container restarts of Running pods: the limit is
    never reached, and the job loops (kubeflow/trainer#2045)."""
    api = k8s.CustomObjectsApi(sim.api_client())
    rv = api.list_namespaced_custom_object(*JOBS)["metadata"]["resourceVersion"]
    api.create_namespaced_custom_object(
        *JOBS, pytorchjob("flaky", "import sys; sys.exit(143)", run_policy={"backoffLimit": 1})
    )
    sim.wait_for(lambda: len(pods_created(sim, rv)) >= 4, 20, "4 attempts of flaky")
    job = sim.fake.get_object("pytorchjobs", "flaky")
    assert not condition(job, "Failed"), job["status"]  # 4 runs, backoffLimit 1
    restarting = [
        condition(e.obj, "Restarting")
        for e in sim.fake.history("pytorchjobs")
        if condition(e.obj, "Restarting").get("status") == "True"
    ]  # it turns to Running while each new pod runs
    assert restarting and restarting[-1]["reason"] == "PyTorchJobRestarting"
    api.delete_namespaced_custom_object(*JOBS, "flaky")


def test_backoff_limit_counts_in_place_restarts_under_on_failure(sim: SimCluster) -> None:
    """OnFailure leaves restarts to the kubelet (restartCount), which PastBackoffLimit sums
    for Running pods: that limit holds."""
    api = k8s.CustomObjectsApi(sim.api_client())
    code = "import sys, time; time.sleep(0.3); sys.exit(1)"  # Running long enough to be seen
    api.create_namespaced_custom_object(
        *JOBS, pytorchjob("onfail", code, restart="OnFailure", run_policy={"backoffLimit": 1})
    )
    sim.wait_for(lambda: sim.condition("pytorchjobs", "onfail", "Failed"), 20, "onfail Failed")
    failed = condition(sim.fake.get_object("pytorchjobs", "onfail"), "Failed")
    assert failed["message"] == (
        "Job onfail has failed because it has reached the specified backoff limit"
    )


def test_backoff_limit_zero_fails_on_the_first_failure(sim: SimCluster) -> None:
    """backoffLimit 0 is the one value ReconcileJobs' new-failure check (NumRequeues 0, plus
    one) enforces under ExitCode."""
    api = k8s.CustomObjectsApi(sim.api_client())
    rv = api.list_namespaced_custom_object(*JOBS)["metadata"]["resourceVersion"]
    api.create_namespaced_custom_object(
        *JOBS, pytorchjob("once", "import sys; sys.exit(143)", run_policy={"backoffLimit": 0})
    )
    sim.wait_for(lambda: sim.condition("pytorchjobs", "once", "Failed"), 20, "once Failed")
    failed = condition(sim.fake.get_object("pytorchjobs", "once"), "Failed")
    assert failed["message"] == (
        "Job once has failed because it has reached the specified backoff limit"
    )
    assert len(pods_created(sim, rv)) == 1


def test_active_deadline_is_enforced_only_when_the_job_is_reconciled(sim: SimCluster) -> None:
    """The operator's requeue at the deadline goes to a work queue that drops it
    (FakeWorkQueue): a quiet job runs past activeDeadlineSeconds until an event about it
    (kubeflow/trainer#3358); then it fails and its pods are deleted."""
    api = k8s.CustomObjectsApi(sim.api_client())
    api.create_namespaced_custom_object(
        *JOBS,
        pytorchjob("slow", "import time; time.sleep(60)", run_policy={"activeDeadlineSeconds": 1}),
    )
    sim.wait_for(lambda: sim.condition("pytorchjobs", "slow", "Running"), 10, "slow Running")
    time.sleep(1.5)
    assert not sim.condition("pytorchjobs", "slow", "Failed")  # past its deadline, running
    assert pod_names(sim) == ["slow-master-0"]
    job = sim.fake.get_object("pytorchjobs", "slow")
    job["metadata"].setdefault("labels", {})["touched"] = "yes"
    sim.fake.put_object("pytorchjobs", job)  # any event reconciles it
    sim.wait_for(lambda: sim.condition("pytorchjobs", "slow", "Failed"), 10, "slow Failed")
    failed = condition(sim.fake.get_object("pytorchjobs", "slow"), "Failed")
    assert (failed["reason"], failed["message"]) == (
        "PyTorchJobFailed",
        "Job slow has failed because it was active longer than specified deadline",
    )
    sim.wait_for(lambda: pod_names(sim) == [], 5, "the pods deleted")


def test_a_permanent_exit_code_failure_is_never_deleted_by_the_ttl(sim: SimCluster) -> None:
    """ReconcilePods marks the job Failed without a completionTime, and CleanupJob cannot
    work out a TTL without one: the job stays."""
    api = k8s.CustomObjectsApi(sim.api_client())
    policy = {"ttlSecondsAfterFinished": 0}
    api.create_namespaced_custom_object(
        *JOBS, pytorchjob("stays", "import sys; sys.exit(1)", run_policy=policy)
    )
    sim.wait_for(lambda: sim.condition("pytorchjobs", "stays", "Failed"), 10, "stays Failed")
    time.sleep(0.5)
    job = sim.fake.get_object("pytorchjobs", "stays")
    assert job is not None and "completionTime" not in job["status"]


def test_worker_pods_get_the_init_pytorch_init_container(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    api.create_namespaced_custom_object(*JOBS, pytorchjob("init", "pass", workers=2))
    sim.wait_for(lambda: sim.condition("pytorchjobs", "init", "Succeeded"), 20, "Succeeded")
    master = sim.fake.get_object("pods", "init-master-0")
    assert "initContainers" not in master["spec"]
    for name in ("init-worker-0", "init-worker-1"):
        (init,) = sim.fake.get_object("pods", name)["spec"]["initContainers"]
        assert init == {
            "name": "init-pytorch",
            "image": "alpine:3.10",
            "imagePullPolicy": "IfNotPresent",
            "resources": {
                "limits": {"cpu": "100m", "memory": "20Mi"},
                "requests": {"cpu": "50m", "memory": "10Mi"},
            },
            "command": [
                "sh",
                "-c",
                "err=1;for i in $(seq 100); do if nslookup init-master-0; then err=0 && break; "
                "fi;echo waiting for master; sleep 2; done; exit $err",
            ],
        }


def test_a_suspended_job_has_no_pods_until_it_is_resumed(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    code = "import time; time.sleep(30)"
    api.create_namespaced_custom_object(
        *JOBS, pytorchjob("queued", code, run_policy={"suspend": True})
    )
    sim.wait_for(lambda: sim.condition("pytorchjobs", "queued", "Suspended"), 10, "Suspended")
    job = sim.fake.get_object("pytorchjobs", "queued")
    suspended = condition(job, "Suspended")
    assert (suspended["reason"], suspended["message"]) == (
        "PyTorchJobSuspended",
        "PyTorchJob queued is suspended.",
    )
    assert condition(job, "Created")["status"] == "True"
    assert "startTime" not in job["status"]
    time.sleep(0.3)
    assert pod_names(sim) == []

    job["spec"]["runPolicy"]["suspend"] = False  # what Kueue does on admission
    sim.fake.put_object("pytorchjobs", job)
    sim.wait_for(lambda: sim.condition("pytorchjobs", "queued", "Running"), 10, "Running")
    job = sim.fake.get_object("pytorchjobs", "queued")
    resumed = condition(job, "Suspended")
    assert (resumed["status"], resumed["reason"], resumed["message"]) == (
        "False",
        "PyTorchJobResumed",
        "PyTorchJob queued is resumed.",
    )
    assert job["status"]["startTime"]

    job["spec"]["runPolicy"]["suspend"] = True  # pre-empted: suspended again while running
    sim.fake.put_object("pytorchjobs", job)
    sim.wait_for(lambda: pod_names(sim) == [], 10, "the pods deleted")
    sim.wait_for(
        lambda: (
            condition(sim.fake.get_object("pytorchjobs", "queued"), "Suspended").get("status")
            == "True"
        ),
        10,
        "Suspended again",
    )
    job = sim.fake.get_object("pytorchjobs", "queued")
    running = condition(job, "Running")
    assert (running["status"], running["reason"]) == ("False", "PyTorchJobSuspended")
    assert "active" not in job["status"]["replicaStatuses"]["Master"]

    started = job["status"]["startTime"]
    time.sleep(1.1)  # startTime has a resolution of seconds
    job["spec"]["runPolicy"]["suspend"] = False  # admitted again: the deadline starts anew
    sim.fake.put_object("pytorchjobs", job)
    sim.wait_for(lambda: sim.condition("pytorchjobs", "queued", "Running"), 10, "Running again")
    assert sim.fake.get_object("pytorchjobs", "queued")["status"]["startTime"] > started
    api.delete_namespaced_custom_object(*JOBS, "queued")


def test_defaults_fill_replicas_restart_policy_and_the_port(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    body = pytorchjob("plain", "pass")
    del body["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"]
    del body["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"]
    api.create_namespaced_custom_object(*JOBS, body)
    sim.wait_for(lambda: sim.condition("pytorchjobs", "plain", "Succeeded"), 10, "Succeeded")
    pod = sim.fake.get_object("pods", "plain-master-0")
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    (container,) = pod["spec"]["containers"]
    assert container["ports"] == [
        {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}
    ]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PET_NPROC_PER_NODE"] == "auto" and env["WORLD_SIZE"] == "1"


def test_restart_policy_never_fails_the_job_on_a_failed_replica(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    api.create_namespaced_custom_object(
        *JOBS, pytorchjob("never", "import sys; sys.exit(137)", restart="Never")
    )
    sim.wait_for(lambda: sim.condition("pytorchjobs", "never", "Failed"), 10, "never Failed")
    job = sim.fake.get_object("pytorchjobs", "never")
    failed = condition(job, "Failed")
    assert (failed["reason"], failed["message"]) == (
        "PyTorchJobFailed",
        "PyTorchJob never is failed because 1 Master replica(s) failed.",
    )
    assert job["status"]["completionTime"]
    assert pod_names(sim) == ["never-master-0"]  # not retried, not deleted (cleanPodPolicy)


def test_a_succeeded_job_counts_its_running_replicas_as_succeeded(
    sim: SimCluster, tmp_path: Path
) -> None:
    """The master's success ends the job; a worker still running is counted succeeded.

    The master waits for the worker to be up: a worker still Pending when the master ends is
    counted nowhere (upstream converts only active replicas), which under load happened."""
    api = k8s.CustomObjectsApi(sim.api_client())
    up = tmp_path / "worker-up"
    code = (
        f"import os, pathlib, time; up = pathlib.Path({str(up)!r})\n"
        "if os.environ['PET_NODE_RANK'] == '0':\n"
        "    end = time.time() + 60\n"
        "    while not up.exists() and time.time() < end: time.sleep(0.1)\n"
        "    time.sleep(1)  # the controller's next sync sees the worker Running\n"
        "else:\n"
        "    up.touch(); time.sleep(30)\n"
    )
    api.create_namespaced_custom_object(*JOBS, pytorchjob("early", code, workers=1))
    sim.wait_for(lambda: sim.condition("pytorchjobs", "early", "Succeeded"), 90, "Succeeded")
    statuses = sim.wait_for(
        lambda: (
            (s := sim.fake.get_object("pytorchjobs", "early")["status"]["replicaStatuses"])
            and "active" not in s["Worker"]
            and "succeeded" in s["Worker"]
            and s
        ),
        15,  # under load the controller's next sync can come a few seconds later
        "the worker counted",
    )
    assert statuses["Worker"] == {
        "succeeded": 1,
        "selector": "training.kubeflow.org/job-name=early,"
        "training.kubeflow.org/operator-name=pytorchjob-controller,"
        "training.kubeflow.org/replica-type=worker",
    }
    assert sim.fake.get_object("pods", "early-worker-0")["status"]["phase"] == "Running"


def test_ttl_deletes_the_finished_job_and_clean_pod_policy_its_pods(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    policy = {"ttlSecondsAfterFinished": 1, "cleanPodPolicy": "All"}
    api.create_namespaced_custom_object(*JOBS, pytorchjob("done", "pass", run_policy=policy))
    sim.wait_for(lambda: sim.condition("pytorchjobs", "done", "Succeeded"), what="Succeeded")
    sim.wait_for(lambda: pod_names(sim) == [], 5, "cleanPodPolicy All")
    sim.wait_for(lambda: sim.fake.get_object("pytorchjobs", "done") is None, 5, "TTL")


# ---------------------------------------------------------------- kubelet and scheduler


def test_extended_resources_beyond_the_node_stay_pending(tmp_path: Path) -> None:
    with SimCluster(tmp_path, gpus_per_node=1) as sim:
        gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
        for name in ("a", "b"):
            body = pytorchjob(name, "import time; time.sleep(0.5)", **gpu)
            sim.fake.create_object("pytorchjobs", body)
        sim.wait_for(lambda: sim.condition("pytorchjobs", "a", "Succeeded"), what="a")
        sim.wait_for(lambda: sim.condition("pytorchjobs", "b", "Succeeded"), what="b")
        scheduled = [
            e.obj["status"]["conditions"][0]
            for e in sim.fake.history("pods")
            if (e.obj.get("status") or {}).get("conditions")
        ]
        unschedulable = [c for c in scheduled if c["status"] == "False"]
        assert unschedulable, "one pod waited for the GPU"
        assert unschedulable[0]["reason"] == "Unschedulable"
        assert (
            unschedulable[0]["message"] == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
        )

        too_big = pytorchjob("c", "pass", resources={"limits": {"nvidia.com/gpu": 2}})
        sim.fake.create_object("pytorchjobs", too_big)
        sim.wait_for(lambda: condition(sim.fake.get_object("pods", "c-master-0"), "PodScheduled"))
        time.sleep(0.3)
        pod = sim.fake.get_object("pods", "c-master-0")
        assert pod is not None and pod["status"]["phase"] == "Pending"
        assert sim.errors == [] and sim.fake.errors == []


def pod_body(name: str, code: str, **extra: Any) -> dict[str, Any]:
    spec = {"restartPolicy": "Never", "containers": [container(code, **extra)]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_a_missing_executable_is_the_runtimes_start_error(sim: SimCluster) -> None:
    """containerd's StartContainer: a process that cannot start is exit code 128, reason
    StartError, the runtime's error as the message."""
    body = pod_body("nox", "")
    body["spec"]["containers"][0]["command"] = ["kubellm-no-such-executable"]
    sim.fake.create_object("pods", body)
    sim.wait_for(
        lambda: (
            (sim.fake.get_object("pods", "nox") or {}).get("status", {}).get("phase") == "Failed"
        ),
        what="the pod fails",
    )
    (status,) = (sim.fake.get_object("pods", "nox") or {})["status"]["containerStatuses"]
    terminated = status["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (128, "StartError")
    assert (
        'exec: "kubellm-no-such-executable": executable file not found in $PATH'
        in (terminated["message"])
    )


def test_a_pod_whose_claim_does_not_exist_is_unschedulable(sim: SimCluster) -> None:
    """VolumeBinding PreFilter: the claim's NotFound error is the FitError's PreFilter part."""
    body = pod_body("claims", "pass")
    body["spec"]["volumes"] = [{"name": "w", "persistentVolumeClaim": {"claimName": "nope"}}]
    sim.fake.create_object("pods", body)
    sim.wait_for(lambda: condition(sim.fake.get_object("pods", "claims"), "PodScheduled"))
    scheduled = condition(sim.fake.get_object("pods", "claims"), "PodScheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    assert (
        scheduled["message"] == '0/1 nodes are available: persistentvolumeclaim "nope" not found.'
    )


def test_env_from_secrets_and_fields_and_config_errors(sim: SimCluster) -> None:
    sim.secrets[("default", "tokens")] = {"hf": "s3cr3t"}
    env = [
        {"name": "HF", "valueFrom": {"secretKeyRef": {"name": "tokens", "key": "hf"}}},
        {
            "name": "OPT",
            "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x", "optional": True}},
        },
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "GREETING", "value": "hi $(POD)"},
    ]
    code = "import os; e = os.environ; print(e['HF'], 'OPT' in e, e['POD'], e['NS'], e['GREETING'])"
    sim.fake.create_object("pods", pod_body("envy", code, env=env))
    sim.wait_for(
        lambda: (
            (sim.fake.get_object("pods", "envy") or {}).get("status", {}).get("phase")
            == "Succeeded"
        )
    )
    assert sim.fake.pod_log("default", "envy") == "s3cr3t False envy default hi envy\n"

    missing = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]
    sim.fake.create_object("pods", pod_body("blocked", "pass", env=missing))

    def waiting() -> dict[str, Any]:
        statuses = ((sim.fake.get_object("pods", "blocked") or {}).get("status") or {}).get(
            "containerStatuses"
        ) or [{}]
        return dict((statuses[0].get("state") or {}).get("waiting") or {})

    sim.wait_for(lambda: waiting().get("reason") == "CreateContainerConfigError")
    assert waiting()["message"] == 'secret "absent" not found'
    sim.secrets[("default", "absent")] = {"k": "v"}  # the kubelet retries, as a real one does
    sim.wait_for(lambda: sim.fake.get_object("pods", "blocked")["status"]["phase"] == "Succeeded")


def test_a_pvc_is_mounted_only_at_its_directory(sim: SimCluster) -> None:
    workspace = sim.pvc_dir("kubellm-workspace")
    (workspace / "data.txt").write_text("tokens")
    volumes = [{"name": "ws", "persistentVolumeClaim": {"claimName": "kubellm-workspace"}}]

    def mounted(name: str, path: str) -> dict[str, Any]:
        body = pod_body(
            name,
            f"print(open('{workspace}/data.txt').read())",
            volumeMounts=[{"name": "ws", "mountPath": path}],
        )
        body["spec"]["volumes"] = volumes
        return body

    sim.fake.create_object("pods", mounted("right", str(workspace)))
    sim.fake.create_object("pods", mounted("wrong", "/workspace"))
    phase = lambda n: (sim.fake.get_object("pods", n) or {}).get("status", {}).get("phase")  # noqa: E731
    sim.wait_for(lambda: phase("right") == "Succeeded" and phase("wrong") == "Failed")
    assert sim.fake.pod_log("default", "right") == "tokens\n"
    wrong = sim.fake.get_object("pods", "wrong")
    assert wrong["status"]["reason"] == "FailedMount"
    assert (
        str(workspace) in wrong["status"]["message"] and "/workspace" in wrong["status"]["message"]
    )
    assert sim.env()["KUBELLM_WORKSPACE_MOUNT"] == str(workspace)


def test_deleting_a_pod_terminates_its_process(sim: SimCluster, tmp_path: Path) -> None:
    marker = tmp_path / "got-sigterm"
    code = textwrap.dedent(
        f"""
        import pathlib, signal, sys, time
        def bye(*_):
            pathlib.Path({str(marker)!r}).write_text("bye")
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    sim.fake.create_object("pods", pod_body("sleeper", code))
    sim.wait_for(lambda: sim.fake.pod_log("default", "sleeper") == "ready\n")
    sim.fake.delete_object("pods", "sleeper")  # the Role has no pod delete: a test control
    sim.wait_for(lambda: marker.exists(), 5, "SIGTERM handled")
    assert sim.fake.get_object("pods", "sleeper") is None


CHILD = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    def bye(*_):
        pathlib.Path(sys.argv[1]).write_text("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    pathlib.Path(sys.argv[2]).write_text(str(os.getpid()))
    time.sleep(60)
    """
)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_deletion_signals_the_main_process_only_then_the_rest_dies(
    sim: SimCluster, tmp_path: Path
) -> None:
    """The runtime's SIGTERM goes to the container's main process, not to its process group:
    with shareProcessNamespace `sh` is not PID 1 and dies of it; its child, which would
    handle SIGTERM, gets none, and is SIGKILLed with the rest of the container at once."""
    script, marker, pidfile = tmp_path / "child.py", tmp_path / "marker", tmp_path / "pid"
    script.write_text(CHILD)
    body = pod_body("wrapped", "")
    body["spec"]["containers"][0]["command"] = [
        "sh",
        "-c",
        f"python {script} {marker} {pidfile} && echo done",
    ]
    body["spec"]["shareProcessNamespace"] = True
    sim.fake.create_object("pods", body)
    sim.wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the child started")
    child = int(pidfile.read_text())
    start = time.monotonic()
    sim.fake.delete_object("pods", "wrapped")
    sim.wait_for(lambda: not alive(child), 3, "the child killed with its container")
    assert time.monotonic() - start < 3  # at once, not after the grace period
    assert not marker.exists()  # no SIGTERM reached the child


def test_pid_1_without_a_handler_ignores_sigterm_until_the_grace_period(
    sim: SimCluster, tmp_path: Path
) -> None:
    """Without shareProcessNamespace the main process is PID 1 of its namespace: the kernel
    drops a signal from outside that it has no handler for, so only the SIGKILL after
    terminationGracePeriodSeconds ends a plain `python` that sleeps."""
    pidfile = tmp_path / "pid"
    code = (
        f"import os, pathlib, time; pathlib.Path({str(pidfile)!r}).write_text(str(os.getpid()))"
        "; time.sleep(60)"
    )
    body = pod_body("stubborn", code)
    body["spec"]["terminationGracePeriodSeconds"] = 1
    sim.fake.create_object("pods", body)
    sim.wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "started")
    pid = int(pidfile.read_text())
    sim.fake.delete_object("pods", "stubborn")
    time.sleep(0.5)
    assert alive(pid)  # the SIGTERM was dropped
    sim.wait_for(lambda: not alive(pid), 3, "SIGKILLed after the grace period")


def test_the_rest_of_a_container_dies_with_its_main_process(
    sim: SimCluster, tmp_path: Path
) -> None:
    """A process the main process left behind is killed when it exits (the kernel does it
    for PID 1, containerd's shim with a shared PID namespace), and the pod completes."""
    script, marker, pidfile = tmp_path / "child.py", tmp_path / "marker", tmp_path / "pid"
    script.write_text(CHILD)
    body = pod_body("leaver", "")
    waits = f"while [ ! -s {pidfile} ]; do sleep 0.05; done"
    body["spec"]["containers"][0]["command"] = [
        "sh",
        "-c",
        f"python {script} {marker} {pidfile} & {waits}; echo started",
    ]
    sim.fake.create_object("pods", body)
    phase = lambda: (sim.fake.get_object("pods", "leaver") or {}).get("status", {}).get("phase")  # noqa: E731
    sim.wait_for(lambda: phase() == "Succeeded", 10, "the pod Succeeded")
    assert sim.fake.pod_log("default", "leaver") == "started\n"
    sim.wait_for(lambda: not alive(int(pidfile.read_text())), 3, "the child killed")
    assert not marker.exists()


# ---------------------------------------------------------------- Katib


def experiment(
    name: str, trial_code: str, max_trials: int = 4, workers: int = 0, **spec: Any
) -> dict[str, Any]:
    """A trial runs `sh -c "python -c '<trial_code>'"`, X replaced by the parameter x: Katib's
    webhook joins a command's words with spaces, unquoted, so code with spaces must come
    quoted inside a shell command of its own (which Katib keeps and appends to)."""
    job = pytorchjob("unused", "", workers=workers)
    del job["metadata"]
    code = trial_code.replace("X", "${trialParameters.x}")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (c,) = replica["template"]["spec"]["containers"]
        c["command"] = ["sh", "-c", f"python -c {shlex.quote(code)}"]
    return {
        "apiVersion": "kubeflow.org/v1beta1",
        "kind": "Experiment",
        "metadata": {"name": name},
        "spec": {
            "objective": {"type": "minimize", "objectiveMetricName": "eval_loss"},
            "algorithm": {
                "algorithmName": "random",
                "algorithmSettings": [{"name": "random_state", "value": "7"}],
            },
            "parallelTrialCount": 2,
            "maxTrialCount": max_trials,
            "maxFailedTrialCount": max_trials,
            "parameters": [
                {
                    "name": "x",
                    "parameterType": "double",
                    "feasibleSpace": {"min": "0.0", "max": "1.0"},
                }
            ],
            "trialTemplate": {
                "primaryContainerName": "pytorch",
                "successCondition": 'status.conditions.#(type=="Succeeded")#|#(status=="True")#',
                "failureCondition": 'status.conditions.#(type=="Failed")#|#(status=="True")#',
                "trialParameters": [{"name": "x", "reference": "x"}],
                "trialSpec": job,
            },
            **spec,
        },
    }


def finished(sim: SimCluster, name: str) -> bool:
    return sim.condition("experiments", name, "Succeeded") or sim.condition(
        "experiments", name, "Failed"
    )


def test_experiment_finds_the_trial_with_the_lowest_objective(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    code = (  # X is the trial's parameter; eval_loss is printed twice, min is the objective
        'x = float("X"); print(f"step=1 eval_loss={(x - 0.3) ** 2 + 1}"); '
        'print(f"eval_loss={(x - 0.3) ** 2}")'
    )
    api.create_namespaced_custom_object(*EXPERIMENTS, experiment("tune", code))
    sim.wait_for(lambda: finished(sim, "tune"), 30, "experiment done")
    exp = api.get_namespaced_custom_object(*EXPERIMENTS, "tune")
    done = condition(exp, "Succeeded")
    assert (done["reason"], done["message"]) == (
        "ExperimentMaxTrialsReached",
        "Experiment has succeeded because max trial count has reached",
    )
    assert condition(exp, "Running")["status"] == "False"
    trials = api.list_namespaced_custom_object(
        "kubeflow.org",
        "v1beta1",
        "default",
        "trials",
        label_selector="katib.kubeflow.org/experiment=tune",
    )["items"]
    assert len(trials) == 4 and exp["status"]["trialsSucceeded"] == 4
    losses = {}
    for t in trials:
        assert t["metadata"]["name"].startswith("tune-") and len(t["metadata"]["name"]) == 13
        (metric,) = t["status"]["observation"]["metrics"]
        x = float(t["spec"]["parameterAssignments"][0]["value"])
        assert float(metric["min"]) == pytest.approx((x - 0.3) ** 2)
        assert metric["latest"] == metric["min"] and float(metric["max"]) > float(metric["min"])
        assert (
            condition(t, "Succeeded")["reason"] == "TrialSucceeded. Job reason: PyTorchJobSucceeded"
        )
        losses[t["metadata"]["name"]] = float(metric["min"])
    best = exp["status"]["currentOptimalTrial"]
    assert best["bestTrialName"] == min(losses, key=lambda n: losses[n])
    assert best["parameterAssignments"][0]["name"] == "x"
    # each trial ran its own job (x substituted), deleted when the trial completed
    for t in trials:
        assert ("pytorchjobs", "default", t["metadata"]["name"]) in sim.fake.deleted
        x = t["spec"]["parameterAssignments"][0]["value"]
        master = t["spec"]["runSpec"]["spec"]["pytorchReplicaSpecs"]["Master"]
        assert f'float("{x}")' in master["template"]["spec"]["containers"][0]["command"][2]
    assert sim.fake.list_objects("pytorchjobs") == []


def test_grid_walks_the_feasible_space_in_steps(sim: SimCluster) -> None:
    body = experiment("grid", "print('eval_loss=X')", max_trials=3, parallelTrialCount=3)
    body["spec"]["algorithm"] = {"algorithmName": "grid"}
    body["spec"]["parameters"][0]["feasibleSpace"] = {"min": "0.1", "max": "0.3", "step": "0.1"}
    sim.fake.create_object("experiments", body)
    sim.wait_for(lambda: finished(sim, "grid"), 30, "experiment done")
    values = sorted(
        float(t["spec"]["parameterAssignments"][0]["value"])
        for t in sim.fake.list_objects("trials")
    )
    assert values == pytest.approx([0.1, 0.2, 0.3])
    best = sim.fake.get_object("experiments", "grid")["status"]["currentOptimalTrial"]
    assert float(best["parameterAssignments"][0]["value"]) == pytest.approx(0.1)


def test_trials_without_the_objective_metric_are_metrics_unavailable(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    body = experiment("nometric", "print('loss X')", max_trials=2, maxFailedTrialCount=2)
    api.create_namespaced_custom_object(*EXPERIMENTS, body)
    sim.wait_for(lambda: finished(sim, "nometric"), 30, "experiment done")
    exp = api.get_namespaced_custom_object(*EXPERIMENTS, "nometric")
    failed = condition(exp, "Failed")
    assert (failed["reason"], failed["message"]) == (
        "ExperimentFailed",
        "Experiment has failed because max failed count has reached",
    )
    assert exp["status"]["trialMetricsUnavailable"] == 2
    trial = sim.fake.get_object("trials", exp["status"]["metricsUnavailableTrialList"][0])
    unavailable = condition(trial, "MetricsUnavailable")
    assert unavailable["reason"] == "MetricsUnavailable. Job reason: PyTorchJobSucceeded"
    assert unavailable["message"].startswith("Metrics are not available. Job message: ")
    assert trial["status"]["observation"]["metrics"] == [
        {"name": "eval_loss", "min": "unavailable", "max": "unavailable", "latest": "unavailable"}
    ]


def test_without_the_collector_injection_label_trials_never_report(sim: SimCluster) -> None:
    # Katib's experiment webhook refuses an Experiment in a namespace without the label...
    sim.namespace_labels["default"] = {}
    api = k8s.CustomObjectsApi(sim.api_client())
    body = experiment("blind", "print('eval_loss=X')", max_trials=1, parallelTrialCount=1)
    with pytest.raises(k8s.ApiException) as info:
        api.create_namespaced_custom_object(*EXPERIMENTS, body)
    assert info.value.status == 400
    assert json.loads(info.value.body)["message"] == (
        'admission webhook "validator.experiment.katib.kubeflow.org" denied the request: '
        'Cannot create the Experiment "blind" in namespace "default": the namespace lacks '
        'label "katib.kubeflow.org/metrics-collector-injection: enabled"'
    )
    # ...but the pod webhook's namespaceSelector is read when a trial's pods are created:
    # a label taken away after the Experiment was made leaves the pods without a collector
    sim.namespace_labels["default"] = {"katib.kubeflow.org/metrics-collector-injection": "enabled"}
    sim.fake.on_create("trials", lambda *_: sim.namespace_labels["default"].clear())
    api.create_namespaced_custom_object(*EXPERIMENTS, body)
    sim.wait_for(lambda: sim.fake.list_objects("trials"), what="a trial")
    name = sim.fake.list_objects("trials")[0]["metadata"]["name"]
    sim.wait_for(lambda: sim.condition("pytorchjobs", name, "Succeeded"), what="its job")
    time.sleep(0.5)
    trial = sim.fake.get_object("trials", name)
    assert condition(trial, "Running")["status"] == "True"  # requeued forever, as in Katib
    assert not finished(sim, "blind")


def test_katibs_experiment_webhook_lets_an_edit_change_only_the_trial_counts(
    sim: SimCluster,
) -> None:
    sim.fake.role = None  # kubellm's Role grants no update on experiments: the rule alone
    api = k8s.CustomObjectsApi(sim.api_client())
    body = experiment("edit", "print('eval_loss=X')", max_trials=1, parallelTrialCount=1)
    api.create_namespaced_custom_object(*EXPERIMENTS, body)
    sim.wait_for(lambda: finished(sim, "edit"), 30, "experiment done")

    def replace(change: dict[str, Any]) -> str:
        current = api.get_namespaced_custom_object(*EXPERIMENTS, "edit")
        current["spec"].update(change)
        with pytest.raises(k8s.ApiException) as info:
            api.replace_namespaced_custom_object(*EXPERIMENTS, "edit", current)
        assert info.value.status == 400
        message: str = json.loads(info.value.body)["message"]
        prefix = 'admission webhook "validator.experiment.katib.kubeflow.org" denied the request: '
        assert message.startswith(prefix)
        return message[len(prefix) :]

    forbidden = (
        "spec: Forbidden: only spec.parallelTrialCount, spec.maxTrialCount and "
        "spec.maxFailedTrialCount are editable"
    )
    not_restartable = (
        'spec.resumePolicy: Invalid value: "Never": Experiment can be restarted if it is in '
        "succeeded state by reaching max trials and spec.resumePolicy = LongRunning or "
        "spec.resumePolicy = FromVolume, when experiment is completed"
    )
    too_few = "spec.maxTrialCount: Invalid value: 1: must be greater than status.trials count"
    # a finished experiment (resumePolicy Never by default) cannot be restarted at all
    assert replace({"maxTrialCount": 2}) == not_restartable
    assert (
        replace(
            {
                "maxTrialCount": 1,
                "parallelTrialCount": 1,
                "objective": {"type": "maximize", "objectiveMetricName": "eval_loss"},
            }
        )
        == f"[{not_restartable}, {too_few}, {forbidden}]"
    )
    # an unchanged spec (metadata only) is no restart
    current = api.get_namespaced_custom_object(*EXPERIMENTS, "edit")
    current["metadata"]["labels"] = {"a": "b"}
    api.replace_namespaced_custom_object(*EXPERIMENTS, "edit", current)
    assert sim.fake.errors == []


def test_katibs_set_condition() -> None:
    """experiments/v1beta1/util.go setCondition: same status and reason is a no-op; else the
    condition is replaced at the end, its lastTransitionTime kept while the status is."""
    from fakes.katib_controller import set_condition

    status: dict[str, Any] = {}
    set_condition(status, "Created", "True", "ExperimentCreated", "Experiment is created")
    set_condition(status, "Running", "True", "ExperimentRunning", "Experiment is running")
    before = json.loads(json.dumps(status))
    set_condition(status, "Created", "True", "ExperimentCreated", "another message")
    assert status == before  # no-op: the message does not count
    first = status["conditions"][0]
    first["lastTransitionTime"] = "2000-01-01T00:00:00Z"
    set_condition(status, "Created", "True", "Recreated", "Experiment is created again")
    assert [c["type"] for c in status["conditions"]] == ["Running", "Created"]
    created = status["conditions"][-1]
    assert created["reason"] == "Recreated"
    assert created["lastTransitionTime"] == "2000-01-01T00:00:00Z"  # the status did not move
    set_condition(status, "Created", "False", "Recreated", "gone")
    assert status["conditions"][-1]["lastTransitionTime"] != "2000-01-01T00:00:00Z"


def test_katibs_update_rules() -> None:
    from fakes.katib_controller import experiment_update_errors

    old = experiment("e", "print('eval_loss=X')", max_trials=4, parallelTrialCount=2)
    old["status"] = {"trials": 2, "conditions": [{"type": "Running", "status": "True"}]}
    more = json.loads(json.dumps(old))
    more["spec"].update(maxTrialCount=6, parallelTrialCount=3, maxFailedTrialCount=1)
    assert experiment_update_errors(more, old) == []  # a running experiment's counts
    fewer = json.loads(json.dumps(old))
    fewer["spec"]["maxTrialCount"] = 2
    assert experiment_update_errors(fewer, old) == [
        "spec.maxTrialCount: Invalid value: 2: must be greater than status.trials count"
    ]
    other = json.loads(json.dumps(old))
    other["spec"]["algorithm"]["algorithmName"] = "grid"
    assert [e.split(":")[0] for e in experiment_update_errors(other, old)] == ["spec"]
    # defaults and empty fields are no change (the defaulter ran; Semantic.DeepEqual)
    defaulted = json.loads(json.dumps(old))
    defaulted["spec"].update(resumePolicy="Never", earlyStopping=None)
    assert experiment_update_errors(defaulted, old) == []
    # LongRunning, succeeded by max trials: restartable with more trials
    done = json.loads(json.dumps(old))
    done["spec"]["resumePolicy"] = "LongRunning"
    done["status"] = {
        "trials": 4,
        "conditions": [
            {"type": "Succeeded", "status": "True", "reason": "ExperimentMaxTrialsReached"}
        ],
    }
    again = json.loads(json.dumps(done))
    again["spec"]["maxTrialCount"] = 8
    assert experiment_update_errors(again, done) == []


def test_katibs_webhook_wraps_the_primary_container_and_reads_the_metrics_file(
    sim: SimCluster,
) -> None:
    """The master pod of a trial: its training container runs under Katib's shell wrapper,
    its output goes to the metrics file (the pod log stays empty), a sidecar is added, and
    the trial's metrics come from that file. The worker pod keeps its command."""
    body = experiment("wrap", 'print("eval_loss=X")', max_trials=1, workers=1)
    body["spec"]["parallelTrialCount"] = 1
    body["spec"]["trialTemplate"]["retain"] = True  # keep the job and pods to look at
    sim.fake.create_object("experiments", body)
    sim.wait_for(lambda: finished(sim, "wrap"), 30, "experiment done")
    (trial,) = sim.fake.list_objects("trials")
    name, x = trial["metadata"]["name"], trial["spec"]["parameterAssignments"][0]["value"]
    assert condition(trial, "Succeeded")["status"] == "True"
    (metric,) = trial["status"]["observation"]["metrics"]
    assert float(metric["latest"]) == pytest.approx(float(x))

    master = sim.fake.get_object("pods", f"{name}-master-0")
    assert master is not None and sim.fake.pod_log("default", f"{name}-master-0") == ""
    spec = master["spec"]
    assert spec["shareProcessNamespace"] is True
    primary, sidecar = spec["containers"]
    assert primary["command"] == ["sh", "-c"]
    (script,) = primary["args"]
    assert script == (
        f"python -c 'print(\"eval_loss={x}\")' 1>/var/log/katib/metrics.log 2>&1 "
        "&& echo completed > /var/log/katib/$$$$.pid"
    )
    assert {
        "name": "KATIB_TRIAL_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['katib.kubeflow.org/trial']"}},
    } in primary["env"]
    assert master["metadata"]["labels"]["katib.kubeflow.org/trial"] == name
    assert sidecar["name"] == "metrics-logger-and-collector"
    assert sidecar["resources"] == {
        "requests": {"cpu": "50m", "memory": "10Mi", "ephemeral-storage": "500Mi"},
        "limits": {"cpu": "500m", "memory": "100Mi", "ephemeral-storage": "5Gi"},
    }
    assert sidecar["args"][sidecar["args"].index("-path") + 1] == "/var/log/katib/metrics.log"
    mount = {"name": "metrics-volume", "mountPath": "/var/log/katib"}
    assert mount in primary["volumeMounts"] and mount in sidecar["volumeMounts"]
    assert {"name": "metrics-volume", "emptyDir": {}} in spec["volumes"]
    folder = sim.kubelet.empty_dir(master, "metrics-volume")
    assert (folder / "metrics.log").read_text() == f"eval_loss={x}\n"
    assert (folder / f"{sim.kubelet.main_pid(master)}.pid").read_text() == "completed\n"

    worker = sim.fake.get_object("pods", f"{name}-worker-0")
    assert worker is not None
    (container,) = worker["spec"]["containers"]  # not the primary pod: no sidecar, no wrapper
    assert container["command"][2] == f"python -c 'print(\"eval_loss={x}\")'"
    assert "shareProcessNamespace" not in worker["spec"]
    assert worker["metadata"]["labels"]["katib.kubeflow.org/trial"] == name
    # the whole line: unbuffered, print writes the text and its newline separately, and the
    # kubelet's pump may copy them one at a time (a busy machine showed the first alone)
    sim.wait_for(
        lambda: sim.fake.pod_log("default", f"{name}-worker-0").endswith("\n"), 10, "worker log"
    )
    assert sim.fake.pod_log("default", f"{name}-worker-0") == f"eval_loss={x}\n"


def test_katib_joins_a_plain_command_unquoted(sim: SimCluster) -> None:
    """wrapWorkerContainer joins the command's words with spaces, without quoting: a
    `python -c` whose code has a space or a parenthesis is a shell syntax error."""
    body = experiment("unquoted", "", max_trials=1, parallelTrialCount=1)
    master = body["spec"]["trialTemplate"]["trialSpec"]["spec"]["pytorchReplicaSpecs"]["Master"]
    master["template"]["spec"]["containers"][0]["command"] = [
        "python",
        "-c",
        "print('eval_loss=${trialParameters.x}')",
    ]
    sim.fake.create_object("experiments", body)
    sim.wait_for(lambda: finished(sim, "unquoted"), 30, "experiment done")
    assert sim.condition("experiments", "unquoted", "Failed")
    (trial,) = sim.fake.list_objects("trials")
    assert condition(trial, "Failed")["reason"] == "TrialFailed. Job reason: PyTorchJobFailed"


# ---------------------------------------------------------------- KServe


def isvc(name: str, uri: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "predictor": {
                "minReplicas": 1,
                "containers": [
                    {
                        "name": "kserve-container",
                        "image": "img",
                        "command": ["python", str(MODEL_SERVER)],
                        "args": [
                            "/mnt/models",
                            "--name",
                            name,
                            "--host",
                            "0.0.0.0",
                            "--port",
                            "8080",
                        ],
                        "env": [{"name": "STORAGE_URI", "value": uri}],
                        "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                    }
                ],
            }
        },
    }


def test_inference_service_serves_and_reports_ready_with_its_url(sim: SimCluster) -> None:
    model = sim.pvc_dir("kubellm-workspace") / "models" / "m1"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"arch": "tiny"}')
    api = k8s.CustomObjectsApi(sim.api_client())
    rv = api.list_namespaced_custom_object(*ISVCS)["metadata"]["resourceVersion"]
    api.create_namespaced_custom_object(*ISVCS, isvc("m1", "pvc://kubellm-workspace/models/m1"))

    stream = watch.Watch().stream(
        api.list_namespaced_custom_object,
        *ISVCS,
        field_selector="metadata.name=m1",
        resource_version=rv,
        timeout_seconds=30,
    )
    states = []
    for event in stream:
        ready = condition(event["raw_object"], "Ready")
        states.append(ready.get("reason") or ready.get("status"))
        if ready.get("status") == "True":
            break
    assert "RevisionMissing" in states and states[-1] == "True"
    obj = api.get_namespaced_custom_object(*ISVCS, "m1")
    status = obj["status"]
    assert status["observedGeneration"] == 1
    assert status["modelStatus"]["transitionStatus"] == "UpToDate"
    assert status["address"]["url"] == status["url"]
    with urllib.request.urlopen(f"{status['url']}/v1/models/m1") as resp:
        assert json.loads(resp.read())["model"] == {"arch": "tiny"}
    body = json.dumps({"instances": [[1, 2]]}).encode()
    with urllib.request.urlopen(f"{status['url']}/v1/models/m1:predict", data=body) as resp:
        assert json.loads(resp.read()) == {"predictions": [[1, 2]]}

    # a spec change is a new revision, ready on its own port; the old one is rolled out
    obj["spec"]["predictor"]["containers"][0]["args"][0] = "/mnt/models/../m1"
    api.replace_namespaced_custom_object(*ISVCS, "m1", obj)
    sim.wait_for(
        lambda: (
            (sim.fake.get_object("inferenceservices", "m1") or {})
            .get("status", {})
            .get("observedGeneration")
            == 2
            and sim.condition("inferenceservices", "m1", "Ready")
        ),
        15,
        "generation 2 ready",
    )
    new = sim.fake.get_object("inferenceservices", "m1")["status"]
    assert new["components"]["predictor"]["latestReadyRevision"] == "m1-predictor-00002"
    assert new["url"] != status["url"]
    sim.wait_for(lambda: len(pod_names(sim)) == 1, 5, "the old revision's pod gone")

    api.delete_namespaced_custom_object(*ISVCS, "m1")
    assert pod_names(sim) == []

    def stopped() -> bool:
        try:
            urllib.request.urlopen(f"{new['url']}/v1/models/m1", timeout=0.5)
        except OSError:
            return True
        return False

    # the kubelet SIGTERMs the predictor and SIGKILLs it after the grace period (capped at
    # sim.grace_cap_s): a server slow to exit under load takes that long, and then some
    sim.wait_for(stopped, sim.grace_cap_s + 10, "the predictor process stopped with its pod")


def test_inference_service_that_cannot_load_is_blocked_with_the_reason(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    api.create_namespaced_custom_object(*ISVCS, isvc("m2", "pvc://kubellm-workspace/models/none"))
    sim.wait_for(
        lambda: (
            condition(sim.fake.get_object("inferenceservices", "m2"), "Ready").get("reason")
            == "RevisionFailed"
        ),
        15,
    )
    status = sim.fake.get_object("inferenceservices", "m2")["status"]
    assert status["modelStatus"]["transitionStatus"] == "BlockedByFailedLoad"
    info = status["modelStatus"]["lastFailureInfo"]
    assert info["reason"] == "ModelLoadFailed" and info["exitCode"] == 3
    assert "no config.json in" in info["message"]
    assert "no config.json" in condition({"status": status}, "Ready")["message"]

    # a model format no installed runtime supports (the sim has KServe's Hugging Face one):
    # components/predictor.go reconcileModel, conditions left as initialized (Unknown)
    runtime = isvc("m3", "")
    runtime["spec"]["predictor"] = {
        "model": {"modelFormat": {"name": "sklearn"}, "storageUri": "pvc://ws/m"}
    }
    api.create_namespaced_custom_object(*ISVCS, runtime)
    sim.wait_for(
        lambda: (
            (sim.fake.get_object("inferenceservices", "m3") or {})
            .get("status", {})
            .get("modelStatus")
        )
    )
    status = sim.fake.get_object("inferenceservices", "m3")["status"]
    assert condition({"status": status}, "Ready")["status"] == "Unknown"
    assert status["modelStatus"]["transitionStatus"] == "InvalidSpec"
    assert status["modelStatus"]["lastFailureInfo"]["reason"] == "NoSupportingRuntime"


# ---------------------------------------------------------------- child processes


def test_code_in_a_child_process_reaches_the_sim_through_kubeconfig(sim: SimCluster) -> None:
    sim.fake.create_object("pytorchjobs", pytorchjob("seen", "pass"))
    code = (
        "from kubernetes import client, config; config.load_kube_config(); "
        "print([o['metadata']['name'] for o in client.CustomObjectsApi()"
        ".list_namespaced_custom_object('kubeflow.org', 'v1', 'default', 'pytorchjobs')['items']])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **sim.env()},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == "['seen']"


def test_create_object_validates_like_a_post(sim: SimCluster) -> None:
    with pytest.raises(ApiError) as info:
        sim.fake.create_object("pods", pod_body("x", "pass", gpus=1))
    assert info.value.code == 422
    assert "spec.containers[0].gpus: unknown field" in info.value.body["message"]
    sim.fake.errors.clear()
