"""A run stopped mid-training, under Argo's emissary semantics, on the simulated cluster.

The step runs as a KFP v2 step does (tests/fakes/emissary.py: emissary -> launcher ->
our Python, one process group) and runs a PyTorchJob through the trainer backend, as the
train stage does. Stopping it the way Argo does on a KFP terminate (SIGTERM to the group;
SIGKILL once the launcher, which has no handler, has died) cuts the step's own SIGTERM
cleanup short: the job runs on. The exit handler (stages.summarize.run, which Argo runs on
a terminated run: kubellm.backends.kubernetes.release) then deletes it, with every other
PyTorchJob and Experiment labelled with the run.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes.config import kube_config
from mlflow.tracking import MlflowClient

from fakes.emissary import EXIT_SIGTERM, EmissaryStep
from fakes.fake_k8s import FakeK8s
from fakes.sim_cluster import SimCluster
from kubellm import backends
from kubellm.backends.base import TrainJob
from kubellm.backends.kubernetes.pytorchjob import pytorchjob_manifest
from kubellm.backends.kubernetes.release import run_selector
from kubellm.config import pipeline_config
from kubellm.stages import summarize
from kubellm.stages.context import JobPlan

NS = "kubellm"
RUN = "3f0c2a1e-77b1-4c5e-9d2a-0123456789ab"
# The fabric check's all-reduces, for as long as the test needs: a PyTorchJob that runs on
# the trainer's launcher path (agent, torchrun, worker) without a dataset.
LONG_JOB = ["--mib", "0.01", "--warmup", "100000000", "--iters", "1"]

# The step's Python: what the train stage does on a cluster, minus MLflow and the data.
STEP = """
import json, sys
from kubellm import backends
from kubellm.backends.base import TrainJob
from kubellm.config import pipeline_config
from kubellm.stages.context import JobPlan

params, run, args = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
cfg = backends.resolve(pipeline_config(params))
job = JobPlan(cfg, run, None).job("train", args, module="kubellm.train.fabric")
backends.select(cfg, run).trainer.run(job)
print("not reached", flush=True)
"""


def params(tmp_path: Path) -> dict[str, Any]:
    return {
        "platform": "kubernetes",
        "namespace": NS,
        "num_nodes": 1,
        "nproc_per_node": 1,
        "mlflow_tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "runs_dir": str(tmp_path / "runs"),
    }


def labelled(sim: SimCluster, plural: str) -> list[str]:
    key, value = run_selector(RUN).split("=")
    return [
        o["metadata"]["name"]
        for o in sim.fake.list_objects(plural, NS)
        if (o["metadata"].get("labels") or {}).get(key) == value
    ]


def phase(sim: SimCluster, pod: str) -> str:
    return str(((sim.fake.get_object("pods", pod, NS) or {}).get("status") or {}).get("phase"))


def test_a_stopped_runs_job_is_left_running_until_the_exit_handler_deletes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    p = params(tmp_path)
    cfg = backends.resolve(pipeline_config(p))
    name = JobPlan(cfg, RUN, None).job("train", LONG_JOB).name
    # MLflow creates its sqlite tables (seconds) while the step starts, not after it
    tables = threading.Thread(target=MlflowClient(cfg.mlflow_tracking_uri).search_experiments)
    tables.start()
    with SimCluster(tmp_path / "cluster") as sim:
        env = {**os.environ, **sim.env(NS), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-c", STEP, json.dumps(p), RUN, json.dumps(LONG_JOB)]
        log = tmp_path / "step.log"
        with log.open("wb") as out, EmissaryStep(argv, env, stdout=out, stderr=out) as step:
            sim.wait_for(lambda: phase(sim, f"{name}-master-0") == "Running", 60, "pod Running")
            sim.wait_for(lambda: sim.condition("pytorchjobs", name, "Running", NS), 30, "Running")

            assert step.stop() == EXIT_SIGTERM  # the launcher died of SIGTERM
        said = log.read_text()

        # the step's own SIGTERM cleanup was cut short: the job and its pod run on
        assert "not reached" not in said
        assert "the job has been deleted" not in said, said[-3000:]
        assert labelled(sim, "pytorchjobs") == [name]
        assert phase(sim, f"{name}-master-0") == "Running"
        deletes = [r for r in sim.fake.requests if r.method == "DELETE" and name in r.path]
        assert deletes == [], "the step's DELETE got through"

        # the exit handler, as KFP's backend runs it on the stopped run (its DAG FAILED)
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", env["KUBECONFIG"])
        tables.join()
        capsys.readouterr()
        result = summarize.run(p, RUN, "FAILED")

        assert labelled(sim, "pytorchjobs") == [] and labelled(sim, "experiments") == []
        assert f"summary: pytorchjob/{name} in {NS}: deleted" in capsys.readouterr().out
        assert result.state == "FAILED"
        sim.wait_for(lambda: sim.fake.get_object("pods", f"{name}-master-0", NS) is None, 10)
        assert sim.fake.forbidden == [] and sim.fake.errors == [] and sim.errors == []


def test_the_fake_emissary_kills_the_step_as_soon_as_the_launcher_is_gone(tmp_path: Path) -> None:
    """The rule the stop above relies on: the step gets SIGTERM, and its handler is cut off
    `reap_delay_s` after the launcher (no handler) has died, however long it wanted."""
    marks = tmp_path / "marks"
    code = f"""
import pathlib, signal, sys, time
marks = pathlib.Path({str(marks)!r})
def bye(signum, frame):
    (marks / "sigterm").write_text("")
    time.sleep(10)
    (marks / "cleaned-up").write_text("")
marks.mkdir()
signal.signal(signal.SIGTERM, bye)
(marks / "ready").write_text("")
time.sleep(60)
"""
    step = EmissaryStep([sys.executable, "-c", code], reap_delay_s=0.5).start()
    try:
        deadline = time.monotonic() + 30
        while not (marks / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert step.stop(timeout_s=5) == EXIT_SIGTERM
    finally:
        step.kill()
    assert (marks / "sigterm").exists()  # the whole group got SIGTERM
    assert not (marks / "cleaned-up").exists()  # and the step died in its handler


def test_given_upstreams_second_the_steps_own_cleanup_usually_deletes_the_job(
    tmp_path: Path,
) -> None:
    """The SIGTERM path stays, as a best effort: with the emissary reaping a second after
    the launcher died (its Wait4 poll), a step against a responsive API server deletes its
    job and exits 143 itself (the launcher's 143 is what the emissary reports)."""
    job = TrainJob(name="llm-train", image="ghcr.io/example/kubellm-trainer:test", train_args=[])
    with FakeK8s() as fake:
        log = tmp_path / "step.log"
        argv = [sys.executable, "-c", CLIENT_STEP, fake.url, json.dumps(pytorchjob_manifest(job))]
        with (
            log.open("wb") as out,
            EmissaryStep(argv, stdout=out, stderr=out, reap_delay_s=1.0) as step,
        ):
            deadline = time.monotonic() + 30
            while not any(r.query.get("watch") for r in fake.requests):
                assert time.monotonic() < deadline, "the step never watched its job"
                time.sleep(0.02)
            assert step.stop() == EXIT_SIGTERM
        assert "the step was stopped (SIGTERM); the job has been deleted" in log.read_text()
        assert fake.get_object("pytorchjobs", "llm-train") is None


# A step that runs one job through KubeClient.run (the trainer's lifecycle) on `url`.
CLIENT_STEP = """
import json, sys
from kubernetes import client as k8s
from kubellm.backends.kubernetes.client import KubeClient, condition_is_true
from kubellm.backends.kubernetes.pytorchjob import PYTORCHJOB

cfg = k8s.Configuration()
cfg.host = sys.argv[1]
KubeClient(k8s.ApiClient(cfg), 1.0).run(
    PYTORCHJOB, "default", json.loads(sys.argv[2]), timeout_s=60,
    done=lambda o: condition_is_true(o, "Succeeded"),
)
"""


def test_the_emissary_reports_the_launchers_status() -> None:
    """0 when the command succeeded; the launcher's glog.Exit 1 for any failure."""
    for code, expected in ((0, 0), (3, 1)):
        step = EmissaryStep([sys.executable, "-c", f"raise SystemExit({code})"]).start()
        assert step.wait(30) == expected


def test_the_champion_is_read_from_the_registry_and_unknown_when_it_cannot_be(
    tmp_path: Path,
) -> None:
    """What the exit handler's cleanup is told: the champion's version, "" when there is
    none (its deployments may go), None when MLflow cannot say (serving ones stay)."""
    cfg = backends.resolve(pipeline_config({**params(tmp_path), "model_name": "llm"}))
    client = MlflowClient(cfg.mlflow_tracking_uri)
    assert summarize.champion_version(cfg) == ""  # no registered model
    client.create_registered_model("llm")
    assert summarize.champion_version(cfg) == ""  # no alias
    client.create_model_version("llm", "file:///nowhere")
    client.set_registered_model_alias("llm", "champion", "1")
    assert summarize.champion_version(cfg) == "1"
    down = cfg.model_copy(update={"mlflow_tracking_uri": "http://127.0.0.1:9"})
    assert summarize.champion_version(down) is None
