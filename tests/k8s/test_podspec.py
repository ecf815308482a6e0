"""The pods a cluster run asks for: resources, placement, fabric profiles, names.

Every body is validated strictly against the vendored upstream schemas (the Training
Operator's PyTorchJob CRD, Katib's OpenAPI spec) plus the webhook rules in
tests/fakes/k8s_schemas.py, for each fabric profile and option.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from fakes.fake_k8s import FakeK8s
from kubellm.backends.base import JOB_NAME_MAX, KATIB_NAME_MAX, TrainJob, TuneRequest, dns_name
from kubellm.backends.kubernetes.katib import build_experiment
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import pytorchjob_manifest
from kubellm.backends.nccl import NCCL_PROFILES
from kubellm.config import ConfigError, pipeline_config
from kubellm.tune.search import SearchParam

# DNS-1035 label, as the Training Operator's webhook validates job names
# (pkg/webhooks/pytorch: apimachineryvalidation.NameIsDNS1035Label) and KServe's IsvcNameFmt.
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def train_job(**overrides: Any) -> TrainJob:
    base: dict[str, Any] = {
        "name": "llm-train",
        "image": "ghcr.io/example/kubellm-trainer:test",
        "train_args": ["--config", "/workspace/run/train.json"],
        "nnodes": 2,
        "nproc_per_node": 8,
        "timeout_s": 3600.0,
        "namespace": "kubellm",
        "workspace_pvc": "team-ws",
        "env": {"MLFLOW_TRACKING_URI": "http://mlflow.kubellm:5000"},
    }
    return TrainJob(**{**base, **overrides})


def settings(**params: Any) -> ClusterSettings:
    """ClusterSettings the way a run gets them: from validated pipeline parameters."""
    base = {"gpus_per_node": 8, "nproc_per_node": 8, "batch_size": 64}
    return ClusterSettings.from_config(pipeline_config({**base, **params}), "run-1234")


def pod_of(body: dict[str, Any], replica: str = "Master") -> dict[str, Any]:
    out: dict[str, Any] = body["spec"]["pytorchReplicaSpecs"][replica]["template"]
    return out


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@dataclass
class Profile:
    params: dict[str, Any]
    rdma_resource: str | None
    nccl: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)


PROFILES = {
    "tcp": Profile({"fabric": "tcp"}, None, {}),
    "rdma-ib": Profile(
        {"fabric": "rdma-ib", "rdma_resource": "rdma/ib", "rdma_count": 2},
        "rdma/ib",
        NCCL_PROFILES["rdma-ib"],
    ),
    "roce-multus-overrides": Profile(
        {
            "fabric": "roce",
            "rdma_resource": "nvidia.com/hostdev",
            "network_annotation": "kubellm/roce-net",
            "nccl_env": {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_IB_GID_INDEX": "5"},
        },
        "nvidia.com/hostdev",
        {**NCCL_PROFILES["roce"], "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1", "NCCL_IB_GID_INDEX": "5"},
        {"k8s.v1.cni.cncf.io/networks": "kubellm/roce-net"},
    ),
}


@pytest.mark.parametrize("name", PROFILES)
def test_fabric_profiles(name: str, fake_k8s: FakeK8s) -> None:
    profile = PROFILES[name]
    body = pytorchjob_manifest(train_job(), settings(**profile.params))
    assert fake_k8s.validate("pytorchjobs", body) == []
    for replica in ("Master", "Worker"):
        template = pod_of(body, replica)
        (container,) = template["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "8"
        rdma = {k: v for k, v in limits.items() if k not in ("cpu", "memory", "nvidia.com/gpu")}
        expected_count = str(profile.params.get("rdma_count", 1))
        assert rdma == ({profile.rdma_resource: expected_count} if profile.rdma_resource else {})
        caps = container["securityContext"]["capabilities"]
        assert caps["drop"] == ["ALL"]
        assert caps.get("add") == (["IPC_LOCK"] if profile.rdma_resource else None)
        env = env_of(container)
        assert {k: v for k, v in env.items() if k.startswith("NCCL_")} == profile.nccl
        annotations = template["metadata"]["annotations"]
        assert profile.annotations.items() <= annotations.items()
        if not profile.annotations:
            assert "k8s.v1.cni.cncf.io/networks" not in annotations


def test_tcp_profile_sets_no_nccl_variables() -> None:
    assert NCCL_PROFILES["tcp"] == {}
    assert ClusterSettings(fabric="tcp").nccl() == {}


def test_rdma_needs_gpus() -> None:
    with pytest.raises(ConfigError, match="fabric=rdma-ib needs gpus_per_node"):
        pipeline_config({"fabric": "rdma-ib"})
    with pytest.raises(ConfigError, match="nccl_env keys must be NCCL_"):
        pipeline_config({"nccl_env": {"LD_PRELOAD": "/x.so"}})


def test_resources_placement_and_lifecycle(fake_k8s: FakeK8s) -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    cluster = settings(
        job_cpu="30",
        job_memory="200Gi",
        shm_size="32Gi",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=[toleration],
        priority_class="training-high",
        job_ttl_hours=2,
        job_grace_seconds=900,
    )
    body = pytorchjob_manifest(train_job(timeout_s=7200.0), cluster)
    assert fake_k8s.validate("pytorchjobs", body) == []
    run_policy = body["spec"]["runPolicy"]
    assert run_policy["activeDeadlineSeconds"] == 7200
    assert run_policy["ttlSecondsAfterFinished"] == 7200
    assert "schedulingPolicy" not in run_policy
    pod = pod_of(body)["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [toleration]
    assert pod["priorityClassName"] == "training-high"
    # the SIGTERM checkpoint gets its time before the kubelet's SIGKILL (default 30 s)
    assert pod["terminationGracePeriodSeconds"] == 900
    (container,) = pod["containers"]
    assert container["resources"]["requests"] == {"cpu": "30", "memory": "200Gi"}
    assert container["resources"]["limits"] == {
        "cpu": "30",
        "memory": "200Gi",
        "nvidia.com/gpu": "8",
    }
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    workspace = next(v for v in pod["volumes"] if v["name"] == "workspace")
    assert workspace["persistentVolumeClaim"]["claimName"] == "team-ws"


def test_default_placement_sets_nothing_cluster_specific(fake_k8s: FakeK8s) -> None:
    body = pytorchjob_manifest(train_job(), settings())
    assert fake_k8s.validate("pytorchjobs", body) == []
    pod = pod_of(body)["spec"]
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        assert key not in pod
    assert "kueue.x-k8s.io/queue-name" not in body["metadata"]["labels"]


def test_kueue_queue_is_a_label_on_the_job(fake_k8s: FakeK8s) -> None:
    body = pytorchjob_manifest(train_job(), settings(queue="gpu-team-a"))
    assert fake_k8s.validate("pytorchjobs", body) == []
    # Kueue's jobframework reads the queue from this label on the job object.
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-team-a"
    assert "schedulingPolicy" not in body["spec"]["runPolicy"]


def test_volcano_queue_is_the_operators_scheduling_policy(fake_k8s: FakeK8s) -> None:
    cluster = settings(queue="gpu", gang_scheduler="volcano", priority_class="high")
    body = pytorchjob_manifest(train_job(nnodes=4), cluster)
    assert fake_k8s.validate("pytorchjobs", body) == []
    policy = body["spec"]["runPolicy"]["schedulingPolicy"]
    assert policy == {"minAvailable": 4, "queue": "gpu", "priorityClass": "high"}
    assert "kueue.x-k8s.io/queue-name" not in body["metadata"]["labels"]


def test_job_pods_get_the_mlflow_credentials_from_the_secret() -> None:
    body = pytorchjob_manifest(train_job(), settings())
    (container,) = pod_of(body)["spec"]["containers"]
    env = env_of(container)
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.kubellm:5000"
    for var, key in (
        ("MLFLOW_TRACKING_USERNAME", "username"),
        ("MLFLOW_TRACKING_PASSWORD", "password"),
    ):
        assert env[var] == {
            "secretKeyRef": {"name": "mlflow-credentials", "key": key, "optional": True}
        }


def test_objects_carry_the_run_label() -> None:
    body = pytorchjob_manifest(train_job(), settings())
    for labels in (body["metadata"]["labels"], pod_of(body)["metadata"]["labels"]):
        assert labels["kubellm.dev/run"] == "run-1234"
        assert labels["app.kubernetes.io/managed-by"] == "kubellm"


@pytest.mark.parametrize(
    "parts",
    [
        ("kubellm-tiny", "train", "3f0c2a1e-77b1"),
        ("9-lives", "train", "abc"),  # digit first: the webhook would reject it as is
        ("a" * 45, "fabric", "3f0c2a1e-77b1"),
        ("x" * 45, "tune", "3f0c2a1e-77b1"),
    ],
)
def test_names_are_dns_1035_and_fit_every_controller(parts: tuple[str, ...]) -> None:
    for limit in (JOB_NAME_MAX, KATIB_NAME_MAX):
        name = dns_name(*parts, max_len=limit)
        assert DNS_1035.match(name), name
        assert len(name) <= limit


def test_truncated_names_stay_distinct() -> None:
    a = dns_name("m" * 45, "train", "run-aaaa", max_len=KATIB_NAME_MAX)
    b = dns_name("m" * 45, "train", "run-bbbb", max_len=KATIB_NAME_MAX)
    assert a != b and len(a) == len(b) == KATIB_NAME_MAX
    assert dns_name("short", "train") == "short-train"  # untouched when it fits


@pytest.mark.parametrize("model_name", ["7b-chat", "Kubellm", "a_b", "x" * 46])
def test_model_name_is_checked_before_anything_runs(model_name: str) -> None:
    with pytest.raises(ConfigError, match="model_name"):
        pipeline_config({"model_name": model_name})


def tune_request(**overrides: Any) -> TuneRequest:
    base: dict[str, Any] = {
        "name": dns_name("x" * 45, "tune", "3f0c2a1e-77b1", max_len=KATIB_NAME_MAX),
        "trial_job": train_job(nnodes=1),
        "space": [
            SearchParam("learning_rate", 1e-4, 1e-2, log=True),
            SearchParam("warmup_steps", 10, 100, kind="int"),
        ],
        "max_trials": 9,
        "parallel_trials": 3,
    }
    return TuneRequest(**{**base, **overrides})


@pytest.mark.parametrize("algorithm", ["random", "tpe", "bayesianoptimization", "grid"])
def test_experiment_for_each_algorithm(algorithm: str, fake_k8s: FakeK8s) -> None:
    cluster = settings(fabric="rdma-ib", queue="q")
    body = build_experiment(tune_request(algorithm=algorithm, early_stopping=True), cluster)
    assert fake_k8s.validate("experiments", body) == []
    spec = body["spec"]
    assert len(body["metadata"]["name"]) <= KATIB_NAME_MAX
    assert spec["algorithm"]["algorithmName"] == algorithm
    assert spec["earlyStopping"] == {"algorithmName": "medianstop"}
    assert spec["parallelTrialCount"] == 3
    params = {p["name"]: p["feasibleSpace"] for p in spec["parameters"]}
    if algorithm == "grid":
        # Katib's grid needs a step for every double parameter; 3 x 3 points = 9 trials.
        assert "algorithmSettings" not in spec["algorithm"]
        assert float(params["learning_rate"]["step"]) == pytest.approx((1e-2 - 1e-4) / 2)
        assert params["warmup_steps"]["step"] == "45"
        assert params["learning_rate"]["distribution"] == "uniform"
    else:
        assert spec["algorithm"]["algorithmSettings"] == [{"name": "random_state", "value": "0"}]
        assert "step" not in params["learning_rate"]
        assert params["learning_rate"]["distribution"] == "logUniform"
    # a trial is the trainer's job: same cluster settings as the final training run
    trial = spec["trialTemplate"]["trialSpec"]
    assert trial["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    (container,) = trial["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_max_failed_trials_defaults_to_all_but_one() -> None:
    assert build_experiment(tune_request())["spec"]["maxFailedTrialCount"] == 8
    spec = build_experiment(tune_request(max_failed_trials=2))["spec"]
    assert spec["maxFailedTrialCount"] == 2
