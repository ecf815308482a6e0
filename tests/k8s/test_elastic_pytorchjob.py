"""An elastic PyTorchJob (elastic_min_nodes) on the simulated cluster survives a killed pod.

The job is the builder's (`build_pytorchjob` with ClusterSettings.elastic_min_nodes), run by
PyTorchJobTrainer; the simulated Training Operator gives each Worker pod the elasticPolicy's
torchrun settings (PET_RDZV_ENDPOINT, PET_RDZV_BACKEND=c10d, PET_NNODES=min:max,
PET_MAX_RESTARTS) and the pods run the real agent (`kubellm.train.agent`, torchrun). One pod
is SIGKILLed after the step-100 checkpoint (an OOM kill, a lost node): the survivor's
elastic agent restarts its workers and waits at the c10d rendezvous, the operator recreates
the dead pod (exit 137, retryable under restartPolicy ExitCode), the two meet again, resume
from the checkpoint, and the exported weights equal an uninterrupted run's, tensor for tensor.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from kubernetes import client as k8s
from safetensors.torch import load_file

from fakes.sim_cluster import SimCluster
from kubellm.backends.base import JobResult, TrainJob
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import PyTorchJobTrainer, pytorchjob_manifest
from kubellm.config import TrainConfig

pytestmark = pytest.mark.slow

NS = "default"
TIMEOUT_S = 240.0
# 600 steps of the tiny model, a checkpoint every 50: the kill follows the step-100 commit,
# so about 500 steps (seconds) are left to interrupt.
VALUES: dict[str, Any] = {"steps": 600, "log_every": 100, "checkpoint_every": 50}
TINY_MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
ELASTIC = ClusterSettings(elastic_min_nodes=2, elastic_max_restarts=3, ttl_seconds=3600)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kubellm.data.prepare import PrepareParams, prepare

    out = tmp_path_factory.mktemp("tiny-ds")
    prepare(PrepareParams(num_records=2000, vocab_size=300, seq_len=16), out)
    return out


# `sim`: tests/k8s/conftest.py (the repo's Role; no errors, nothing forbidden)


def _job(tmp: Path, name: str, dataset: Path) -> TrainJob:
    """Two nodes, one worker each, checkpointing into tmp/<name>-ckpt."""
    cfg = TrainConfig.model_validate(
        {
            "dataset_dir": str(dataset),
            "output_dir": str(tmp / f"{name}-model"),
            "checkpoint_dir": str(tmp / f"{name}-ckpt"),
            "batch_size": 8,
            "eval_batches": 2,
            "model": TINY_MODEL,
            **VALUES,
        }
    )
    config = tmp / f"{name}.json"
    config.write_text(cfg.model_dump_json())
    return TrainJob(
        name=name,
        train_args=["--config", str(config)],
        nnodes=2,
        nproc_per_node=1,
        timeout_s=TIMEOUT_S,
        image="ghcr.io/kubellm/trainer:test",
        # LOGLEVEL=INFO: each agent logs its rendezvous rounds and worker-group restarts
        env={"OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"},
    )


class Run:
    """PyTorchJobTrainer.run(job) on a thread; the test plays the cluster's failures."""

    def __init__(self, sim: SimCluster, job: TrainJob) -> None:
        self.sim, self.job = sim, job
        self.result: JobResult | None = None
        self.error: BaseException | None = None
        self.core = k8s.CoreV1Api(sim.api_client())
        trainer = PyTorchJobTrainer(sim.api_client(), cluster=ELASTIC, poll_interval_s=0.2)
        self._thread = threading.Thread(target=self._run, args=(trainer,), daemon=True)
        self._thread.start()

    def _run(self, trainer: PyTorchJobTrainer) -> None:
        try:
            self.result = trainer.run(self.job)
        except BaseException as err:  # re-raised in finish()
            self.error = err

    def pod(self, index: int) -> dict[str, Any] | None:
        return self.sim.fake.get_object("pods", f"{self.job.name}-worker-{index}", NS)

    def log(self, index: int) -> str:
        try:
            resp = self.core.read_namespaced_pod_log(
                f"{self.job.name}-worker-{index}", NS, _preload_content=False
            )
        except k8s.ApiException:
            return ""
        return str(resp.data.decode(errors="replace"))

    def wait_log(self, pattern: str) -> int:
        """The index of the first pod whose log matches `pattern`."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            for index in (0, 1):
                if re.search(pattern, self.log(index), re.M):
                    return index
            if not self._thread.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no pod log matches {pattern!r}:\n{self.tails()}")

    def finish(self) -> JobResult:
        self._thread.join(TIMEOUT_S + 30)
        if self.error is not None:
            raise AssertionError(f"{self.error}\n{self.tails()}") from self.error
        assert self.result is not None, self.tails()
        return self.result

    def tails(self) -> str:
        return "\n".join(
            f"--- {self.job.name}-worker-{i}\n" + "\n".join(self.log(i).splitlines()[-40:])
            for i in (0, 1)
        )


def _store_host(run: Run, port: int) -> int | None:
    """The worker index whose agent hosts the c10d TCPStore (listens on the rdzv port)."""
    for index in (0, 1):
        pid = run.sim.kubelet.main_pid(run.pod(index) or {"metadata": {"uid": ""}})
        if pid is None:
            continue
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
            for proc in procs:
                for conn in proc.connections(kind="tcp"):  # psutil>=5.9 (net_connections: 6.0)
                    if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                        return index
        except psutil.Error:
            continue
    return None


def _env(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def test_the_elastic_job_is_workers_only_with_c10d_min_max_and_max_restarts() -> None:
    job = TrainJob(name="el", train_args=[], nnodes=3, nproc_per_node=2, image="img")
    body = pytorchjob_manifest(job, ClusterSettings(elastic_min_nodes=2, elastic_max_restarts=5))
    spec = body["spec"]
    assert spec["elasticPolicy"] == {
        "minReplicas": 2,
        "maxReplicas": 3,
        "maxRestarts": 5,
        "rdzvBackend": "c10d",
    }
    assert list(spec["pytorchReplicaSpecs"]) == ["Worker"]
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert spec["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
    assert spec["nprocPerNode"] == "2"  # not the deprecated elasticPolicy.nProcPerNode
    fixed = pytorchjob_manifest(job, ClusterSettings())
    assert "elasticPolicy" not in fixed["spec"]
    assert list(fixed["spec"]["pytorchReplicaSpecs"]) == ["Master", "Worker"]
    with pytest.raises(ValueError, match=r"elastic_min_nodes \(4\) is above nnodes \(3\)"):
        pytorchjob_manifest(job, ClusterSettings(elastic_min_nodes=4))


@pytest.mark.parametrize("kill_store_host", [False, True], ids=["a-peer", "the-store-host"])
def test_an_elastic_job_survives_a_killed_pod_and_ends_equal_to_an_uninterrupted_run(
    sim: SimCluster, dataset: Path, tmp_path: Path, kill_store_host: bool
) -> None:
    """a-peer: the survivor's agent restarts its workers and waits; the-store-host (on a
    cluster: worker-0, the endpoint's host): the survivor's agent loses the c10d store and
    exits EXIT_RENDEZVOUS_LOST (retryable), so the operator recreates both pods and the new
    pair meets at a new store. Either way the run resumes the step-100 checkpoint."""
    reference = Run(sim, _job(tmp_path, "ref", dataset)).finish()
    assert reference.metrics.get("world_size") in (None, 2.0), reference.logs[-2000:]

    run = Run(sim, _job(tmp_path, "elastic", dataset))
    run.wait_log(r"train: checkpoint .*step-00000100 committed")
    first = {i: run.pod(i) for i in (0, 1)}
    assert all(first.values())
    env = _env(first[0] or {})
    # the operator's elastic env (pytorch/elastic.go at v1.9.0), instead of a Master's
    assert env["PET_RDZV_BACKEND"] == "c10d"
    assert env["PET_NNODES"] == "2:2" and env["PET_MAX_RESTARTS"] == "3"
    assert env["PET_NPROC_PER_NODE"] == "1"
    assert "MASTER_ADDR" not in env and "PET_NODE_RANK" not in env
    assert _env(first[1] or {})["PET_RDZV_ENDPOINT"] == env["PET_RDZV_ENDPOINT"]
    assert (first[0] or {})["metadata"]["labels"]["training.kubeflow.org/job-role"] == "master"
    port = int(env["PET_RDZV_ENDPOINT"].rsplit(":", 1)[1])
    # Which pod hosts the rendezvous store: on a cluster worker-0, whose host name the
    # endpoint names; here the first agent to bind it (the sim's pods share 127.0.0.1).
    host = _store_host(run, port)
    assert host is not None, run.tails()
    victim = host if kill_store_host else 1 - host
    survivor = 1 - victim
    before_kill = run.log(survivor)
    run.sim.kubelet.signal_pod(NS, f"elastic-worker-{victim}", signal.SIGKILL)
    result = run.finish()

    logs = {i: run.log(i) for i in (0, 1)}
    tails = run.tails()
    # the operator recreated the killed pod (a new uid)
    again = {i: run.pod(i) for i in (0, 1)}
    uid = {
        i: ((again[i] or {})["metadata"]["uid"], (first[i] or {})["metadata"]["uid"])
        for i in (0, 1)
    }
    assert uid[victim][0] != uid[victim][1]
    text = logs[survivor]
    after_kill = text[len(before_kill) :] if text.startswith(before_kill) else text
    if kill_store_host:
        # the survivor's agent lost the store: a retryable exit, and a new pod in its place
        assert "exiting with 201 (retryable" in after_kill, tails
        assert uid[survivor][0] != uid[survivor][1]
    else:
        # the survivor's agent restarted its workers in its own pod: "Worker group FAILED.
        # 3/3 attempts left; will restart worker group" (PET_MAX_RESTARTS=3), or a restart
        # for the new node's membership change
        assert re.search(r"will restart worker group", after_kill), tails
        assert uid[survivor][0] == uid[survivor][1]
    # global rank 0 says where it resumed (the first run started on an empty checkpoint
    # directory, so any such line comes after the kill); in the sim rank 0 is the oldest
    # agent (c10d sorts nodes by host name, then pid, and the pods share one host name)
    every = "\n".join(logs.values())
    resumed = re.findall(r"train: resumed from .*step-(\d+) at step (\d+)", every)
    assert resumed, tails
    from_ckpt, at_step = (int(n) for n in resumed[-1])
    assert from_ckpt == at_step and 100 <= at_step < VALUES["steps"], tails
    steps_done = f"step={VALUES['steps']} "
    assert any(steps_done in text for text in logs.values()), tails
    assert result.name == "elastic"
    ref, got = _weights(tmp_path / "ref-model"), _weights(tmp_path / "elastic-model")
    assert ref.keys() == got.keys()
    differ = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert differ == [], tails


# ---------------------------------------------------------------- the operator's elastic rules

JOBS = ("kubeflow.org", "v1", NS, "pytorchjobs")


def _body(
    name: str, code: str, elastic: dict[str, Any], workers: int = 2, **spec: Any
) -> dict[str, Any]:
    """A worker-only PyTorchJob whose pods run `python -c code`."""
    container = {"name": "pytorch", "image": "img", "command": ["python", "-c", code]}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "elasticPolicy": elastic,
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": workers,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [container]}},
                }
            },
            **spec,
        },
    }


def _pod_env(sim: SimCluster, name: str) -> list[tuple[str, str]]:
    pod = sim.wait_for(lambda: sim.fake.get_object("pods", name, NS), 10, f"pod {name}")
    (container,) = pod["spec"]["containers"]
    return [(e["name"], e.get("value", "")) for e in container["env"]]


def test_the_operator_turns_the_elastic_policy_into_torchruns_env(sim: SimCluster) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    policy = {
        "maxReplicas": 3,  # minReplicas defaults to it (setElasticPolicy)
        "maxRestarts": 2,
        "rdzvId": "run-1",
        "rdzvConf": [{"key": "join_timeout", "value": "60"}, {"key": "a", "value": "b"}],
        "nProcPerNode": 1,  # deprecated: spec.nprocPerNode is then not defaulted to auto
    }
    api.create_namespaced_custom_object(*JOBS, _body("el", "pass", policy))
    env = _pod_env(sim, "el-worker-1")
    names = [n for n, _ in env]
    assert names == [
        "PYTHONUNBUFFERED",
        "PET_RDZV_ENDPOINT",
        "PET_RDZV_BACKEND",
        "PET_NNODES",
        "PET_MAX_RESTARTS",
        "PET_NPROC_PER_NODE",
        "PET_RDZV_ID",
        "PET_RDZV_CONF",
    ]
    values = dict(env)
    assert values["PET_NNODES"] == "3:3" and values["PET_RDZV_BACKEND"] == "c10d"
    assert values["PET_MAX_RESTARTS"] == "2" and values["PET_NPROC_PER_NODE"] == "1"
    assert values["PET_RDZV_ID"] == "run-1"
    assert values["PET_RDZV_CONF"] == "join_timeout=60,a=b"
    host, port = values["PET_RDZV_ENDPOINT"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0  # the sim's `el-worker-0:23456`
    assert dict(_pod_env(sim, "el-worker-0"))["PET_RDZV_ENDPOINT"] == values["PET_RDZV_ENDPOINT"]
    # no Master: worker-0 has the master role, and no pod gets the init container
    pods = {i: sim.fake.get_object("pods", f"el-worker-{i}", NS) or {} for i in (0, 1)}
    roles = [p["metadata"]["labels"].get("training.kubeflow.org/job-role") for p in pods.values()]
    assert roles == ["master", None]
    assert not any(p["spec"].get("initContainers") for p in pods.values())

    # neither min nor max: both are the Worker replicas; rdzvHost/rdzvPort and standalone
    # are passed as they are, and spec.nprocPerNode (default auto) comes before them
    policy = {"rdzvHost": "rdzv.example", "rdzvPort": 29400, "standalone": True}
    api.create_namespaced_custom_object(*JOBS, _body("el2", "pass", policy))
    env = _pod_env(sim, "el2-worker-0")
    assert env[1:] == [
        ("PET_NPROC_PER_NODE", "auto"),
        ("PET_RDZV_ENDPOINT", "rdzv.example:29400"),
        ("PET_RDZV_BACKEND", "c10d"),
        ("PET_NNODES", "2:2"),
        ("PET_STANDALONE", ""),
    ]


def test_an_elastic_job_succeeds_once_any_worker_succeeds(sim: SimCluster) -> None:
    """pytorchjob_controller.go L404-418: with an elasticPolicy, one succeeded Worker is the
    job's success (a fixed-size job without a Master waits for every Worker)."""
    api = k8s.CustomObjectsApi(sim.api_client())
    code = (
        "import os, sys, time\nif os.environ['HOSTNAME_INDEX'] != '0': time.sleep(60)\nsys.exit(0)"
    )
    body = _body("any", code, {"minReplicas": 1, "maxReplicas": 2})
    container = body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["env"] = [
        {
            "name": "HOSTNAME_INDEX",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.labels['training.kubeflow.org/replica-index']"}
            },
        }
    ]
    api.create_namespaced_custom_object(*JOBS, body)
    sim.wait_for(lambda: sim.condition("pytorchjobs", "any", "Succeeded"), 30, "Succeeded")
    job = api.get_namespaced_custom_object(*JOBS, "any")
    succeeded = next(c for c in job["status"]["conditions"] if c["type"] == "Succeeded")
    assert succeeded["message"] == "PyTorchJob default/any successfully completed."
    phase = (sim.fake.get_object("pods", "any-worker-1", NS) or {})["status"]["phase"]
    assert phase == "Running"  # cleanPodPolicy None: the other worker runs on


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {
                "elasticPolicy": {"minReplicas": 1},
                "pytorchReplicaSpecs": {
                    "Master": {
                        "replicas": 1,
                        "template": {"spec": {"containers": [{"name": "pytorch", "image": "img"}]}},
                    }
                },
            },
            "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic "
            "policy is used",
        ),
        (
            {
                "elasticPolicy": {"nProcPerNode": 2},
                "nprocPerNode": "2",
                "pytorchReplicaSpecs": {
                    "Worker": {
                        "replicas": 1,
                        "template": {"spec": {"containers": [{"name": "pytorch", "image": "img"}]}},
                    }
                },
            },
            "spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode",
        ),
    ],
)
def test_the_webhook_refuses_an_elastic_policy_it_cannot_run(
    sim: SimCluster, spec: dict[str, Any], message: str
) -> None:
    api = k8s.CustomObjectsApi(sim.api_client())
    body = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "bad"}}
    with pytest.raises(k8s.ApiException) as info:
        api.create_namespaced_custom_object(*JOBS, {**body, "spec": spec})
    assert info.value.status == 422
    assert message in str(info.value.body)
    assert sim.fake.errors == [f"pytorchjobs/bad: {message}"]
    sim.fake.errors.clear()  # the refusal above is the point of the test
