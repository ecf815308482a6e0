"""The Kubeflow SDK's TrainerClient (`kubeflow` 0.5.0, kubeflow/sdk) reads the TrainJobs
kubellm creates: a real client nobody here wrote, pointed at the simulated cluster.

TrainJobTrainer creates the TrainJob on the ClusterTrainingRuntime we ship
(manifests/cluster/trainer-v2); the sim's Trainer v2 and JobSet controllers run its node pods
as local processes (a tiny worker module under torchrun's agent, as on a cluster). Then
TrainerClient, through a kubeconfig as a user's laptop has it, lists the job with its
runtime, shows its status (Running while the nodes run, then Complete or Failed) and its
steps (node-0, node-1 with their pods), and reads node-0's log, at once or followed.

What the SDK requests (kubeflow/trainer/backends/kubernetes/backend.py at 0.5.0):
GET configmaps kubeflow-system/kubeflow-trainer-public (verify_backend: a warning if absent),
GET/LIST trainjobs, GET trainingruntimes in the namespace (404, then the cluster's)
and clustertrainingruntimes/{runtimeRef.name} (its `trainer.kubeflow.org/framework` label and
a `node` container with an image under the ancestor-labelled replicatedJob, else the job
cannot be read), LIST pods with `jobset.sigs.k8s.io/jobset-name=<name>,
jobset.sigs.k8s.io/replicatedjob-name in (dataset-initializer, model-initializer, launcher,
node)` (steps named by `batch.kubernetes.io/job-completion-index`) and pods/{name}/log with
container `node` (`follow=true` through kubernetes.watch).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubeflow.common.types import KubernetesBackendConfig
from kubeflow.trainer import TrainerClient
from kubernetes import client as k8s

from fakes.fake_k8s import FakeK8s
from fakes.sim_cluster import SimCluster
from kubellm.backends.base import JobFailed, JobResult, TrainJob
from kubellm.backends.kubernetes.trainjob import (
    RUNTIME_NAME,
    TrainJobTrainer,
    training_runtime_manifest,
    trainjob_manifest,
)

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "manifests" / "cluster" / "trainer-v2" / "clustertrainingruntime.yaml"

# Trainer v2.3.0's manager overlay generates it (manifests/overlays/manager/kustomization.yaml,
# configMapGenerator kubeflow-trainer-public); the SDK reads the version from it.
TRAINER_PUBLIC = {
    ("kubeflow-system", "kubeflow-trainer-public"): {"kubeflow_trainer_version": "v2.3.0"}
}

# The worker torchrun starts on each node: a line naming its node, a metric line, and (with
# a gate file) a wait, so the test sees the job Running before it lets it finish.
WORKER = """\
import os, sys, time
node = os.environ["GROUP_RANK"]
print(f"hello from kubellm node {node}", flush=True)
print("loss=1.25", flush=True)
gate = os.environ.get("GATE")
deadline = time.monotonic() + 60
while gate and not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimCluster]:
    # RBAC off: TrainerClient runs as a person, who reads cluster-scoped runtimes and
    # kubeflow-system's ConfigMap, which the pipeline's Role (one for every request here)
    # does not grant.
    with SimCluster(tmp_path, rbac=None) as cluster:
        cluster.fake.create_object("clustertrainingruntimes", yaml.safe_load(RUNTIME.read_text()))
        cluster.config_maps.update(TRAINER_PUBLIC)
        yield cluster
        assert cluster.errors == []
        assert cluster.fake.errors == []


@pytest.fixture
def trainer_client(sim: SimCluster, monkeypatch: pytest.MonkeyPatch) -> TrainerClient:
    """TrainerClient as a user makes it: a kubeconfig file and a namespace. load_kube_config
    sets the kubernetes client's process-wide default Configuration; it is put back after."""
    monkeypatch.setattr(k8s.Configuration, "_default", k8s.Configuration._default)
    config = KubernetesBackendConfig(namespace="default", config_file=str(sim.kubeconfig()))
    return TrainerClient(backend_config=config)


def train_job(
    tmp_path: Path, name: str, nnodes: int = 2, write: bool = True, **env: str
) -> TrainJob:
    if write:
        (tmp_path / "mods").mkdir(exist_ok=True)
        (tmp_path / "mods" / "tclient_worker.py").write_text(WORKER)
    path = os.pathsep.join(p for p in (str(tmp_path / "mods"), os.environ.get("PYTHONPATH")) if p)
    return TrainJob(
        name=name,
        train_args=[],
        module="tclient_worker",
        nnodes=nnodes,
        timeout_s=120.0,
        image="ghcr.io/kubellm/trainer:0.1.0",
        env={"PYTHONPATH": path, **env},
    )


def run_in_thread(sim: SimCluster, job: TrainJob) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = TrainJobTrainer(sim.api_client(), poll_interval_s=0.2).run(job)
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def status_of(client: TrainerClient, name: str) -> str:
    return str(client.get_job(name).status)


def test_trainer_client_lists_shows_and_reads_logs_of_our_trainjob(
    sim: SimCluster, trainer_client: TrainerClient, tmp_path: Path
) -> None:
    gate = tmp_path / "go"
    job = train_job(tmp_path, "llm-train", GATE=str(gate))
    thread, out = run_in_thread(sim, job)

    sim.wait_for(lambda: sim.fake.get_object("trainjobs", "llm-train"), 30, "the TrainJob")
    sim.wait_for(lambda: status_of(trainer_client, "llm-train") == "Running", 60, "Running")
    (listed,) = [j for j in trainer_client.list_jobs() if j.name == "llm-train"]
    assert listed.runtime.name == RUNTIME_NAME
    assert listed.runtime.trainer.framework == "torch"
    assert listed.runtime.trainer.image == "ghcr.io/kubellm/trainer:0.1.0"
    assert listed.num_nodes == 2
    assert [j.name for j in trainer_client.list_jobs(runtime=listed.runtime)] == ["llm-train"]

    running = trainer_client.get_job("llm-train")
    steps = sorted(running.steps, key=lambda s: s.name)
    assert [s.name for s in steps] == ["node-0", "node-1"]
    assert [s.status for s in steps] == ["Running", "Running"]
    pods = {p["metadata"]["name"] for p in sim.fake.list_objects("pods", "default")}
    assert {s.pod_name for s in steps} <= pods
    assert steps[0].pod_name.startswith("llm-train-node-0-0-")
    assert steps[1].pod_name.startswith("llm-train-node-0-1-")
    assert {s.device_count for s in steps} == {"1"}  # PET_NPROC_PER_NODE in the pod env
    sim.wait_for(
        lambda: "hello from kubellm node 0" in list(trainer_client.get_job_logs("llm-train")),
        30,
        "node-0's first line",
    )

    followed: list[str] = []
    follower = threading.Thread(
        target=lambda: followed.extend(trainer_client.get_job_logs("llm-train", follow=True)),
        daemon=True,
    )
    follower.start()

    gate.touch()
    thread.join(60)
    follower.join(30)
    assert not follower.is_alive()  # the stream ends when the pod has terminated
    assert "hello from kubellm node 0" in followed and "loss=1.25" in followed
    assert "error" not in out, out.get("error")
    result: JobResult = out["result"]
    assert result.metrics == {"loss": 1.25}

    done = trainer_client.wait_for_job_status("llm-train", timeout=30, polling_interval=1)
    assert done.status == "Complete"
    assert {s.status for s in done.steps} == {"Succeeded"}
    lines = list(trainer_client.get_job_logs("llm-train"))
    assert "hello from kubellm node 0" in lines
    assert "loss=1.25" in lines
    assert "hello from kubellm node 1" not in lines  # node-0's log, the SDK's default step
    node1 = list(trainer_client.get_job_logs("llm-train", step="node-1"))
    assert "hello from kubellm node 1" in node1


def test_trainer_client_shows_a_failed_trainjob_as_failed(
    sim: SimCluster, trainer_client: TrainerClient, tmp_path: Path
) -> None:
    # Exit 2 (bad config or data): the runtime's podFailurePolicy fails the Job at once, and
    # its FailJobSet rule the JobSet, without a restart.
    # One node: a failing Job deletes its other active pods (node-0 among them, were node-1
    # the first to fail), so only a one-node job surely keeps node-0's pod and log.
    job = train_job(tmp_path, "llm-bad", nnodes=1, EXIT="2")
    with pytest.raises(JobFailed, match="FailJobSet"):
        TrainJobTrainer(sim.api_client(), poll_interval_s=0.2).run(job)
    jobset = sim.fake.get_object("jobsets", "llm-bad", job.namespace)
    assert jobset is not None and jobset["status"].get("restarts", 0) == 0

    failed = trainer_client.wait_for_job_status("llm-bad", {"Failed"}, 30, 1)
    assert failed.status == "Failed"
    assert [(s.name, s.status) for s in failed.steps] == [("node-0", "Failed")]
    assert "llm-bad" in [j.name for j in trainer_client.list_jobs()]
    with pytest.raises(RuntimeError, match="TrainJob llm-bad is Failed"):
        trainer_client.wait_for_job_status("llm-bad", timeout=30, polling_interval=1)
    assert "hello from kubellm node 0" in list(trainer_client.get_job_logs("llm-bad"))


@pytest.mark.parametrize(
    ("image", "readable"), [("ghcr.io/kubellm/trainer:0.1.0", True), ("", False)]
)
def test_the_sdk_reads_a_trainjob_only_on_a_runtime_with_a_node_image(
    image: str, readable: bool
) -> None:
    """TrainerClient reads the runtime a TrainJob names: the `node` container of the
    ancestor-labelled replicatedJob must have an image (kubeflow/sdk 0.5.0
    backends/kubernetes/utils.py get_runtime_trainer), as upstream's runtimes and
    manifests/cluster/trainer-v2 (training_runtime_manifest with the trainer image) have. No
    controllers here: the TrainJob is as created, Created with no steps yet."""
    with FakeK8s(rbac=None) as fake:
        fake.config_maps.update(TRAINER_PUBLIC)
        fake.create_object("clustertrainingruntimes", training_runtime_manifest(image=image))
        body = trainjob_manifest(train_job(Path("/nonexistent"), "llm-train", write=False))
        fake.create_object("trainjobs", body)
        cfg = k8s.Configuration()
        cfg.host = fake.url
        client = TrainerClient(
            KubernetesBackendConfig(namespace="default", client_configuration=cfg)
        )
        if readable:
            job = client.get_job("llm-train")
            assert (job.status, job.steps, job.num_nodes) == ("Created", [], 2)
            assert job.runtime.trainer.image == image
        else:
            with pytest.raises(RuntimeError, match="Failed to get Runtime: kubellm-torch") as info:
                client.get_job("llm-train")
            assert "doesn't have trainer container" in str(info.value.__cause__)
        assert fake.errors == []
