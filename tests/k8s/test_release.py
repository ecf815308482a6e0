"""The exit handler's cleanup on a cluster (Backends.release_run and the backends' release
methods) against the fake API server: the run's jobs and experiments are deleted, what it
deployed and did not promote stops serving, the champion's deployment and other runs'
objects are left alone, every request is one the Role allows, and 404s and transient
errors do not stop it.

Why the exit handler (and not only the stopped step) must do it: kubellm.backends.
kubernetes.release; tests/stages/test_summarize_release.py shows the stop on the simulated
cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakes.fake_k8s import FakeK8s
from kubellm.backends.base import TrainJob
from kubellm.backends.kubernetes.inferenceservice import InferenceServiceServer
from kubellm.backends.kubernetes.katib import KatibTuner, build_experiment
from kubellm.backends.kubernetes.podspec import RUN_LABEL, ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import PyTorchJobTrainer, pytorchjob_manifest
from kubellm.backends.kubernetes.release import run_selector
from kubellm.backends.kubernetes.trainjob import trainjob_manifest

from .conftest import POLL_S, RUNNING, SUCCEEDED
from .test_inferenceservice import (
    CANARY,
    FAILED_FIRST,
    NS,
    PROMOTED,
    REV1,
    REV2,
    ROLLED_BACK,
    SERVING,
    STARTING,
    percent_sent,
    puts,
    request,
    stored,
)
from .test_katib import RUNNING as EXPERIMENT_RUNNING
from .test_katib import request as tune_request

RUN, OTHER = "3f0c2a1e-77b1-4c5e-9d2a-0123456789ab", "9e8d7c6b-0000-4c5e-9d2a-ba9876543210"


def job(fake: FakeK8s, name: str, run: str, status: dict[str, Any] = RUNNING) -> None:
    """A PyTorchJob as the trainer of run `run` creates it (its labels), in some state."""
    body = pytorchjob_manifest(
        TrainJob(name=name, image="ghcr.io/example/kubellm-trainer:test", train_args=["-x"]),
        ClusterSettings(run_id=run),
    )
    fake.create_object("pytorchjobs", body)
    fake.set_status("pytorchjobs", name, status)


def experiment(fake: FakeK8s, name: str, run: str) -> None:
    fake.create_object(
        "experiments", build_experiment(tune_request(name=name), ClusterSettings(run_id=run))
    )
    fake.set_status("experiments", name, EXPERIMENT_RUNNING)


def names(fake: FakeK8s, plural: str) -> list[str]:
    return [o["metadata"]["name"] for o in fake.list_objects(plural)]


def test_the_runs_jobs_and_experiments_are_deleted_and_other_runs_kept(fake_k8s: FakeK8s) -> None:
    job(fake_k8s, "llm-train-3f0c2a1e", RUN)  # stopped mid-training: still Running
    job(fake_k8s, "llm-fabric-3f0c2a1e", RUN, SUCCEEDED)  # preflight's, finished
    job(fake_k8s, "llm-train-9e8d7c6b", OTHER)  # another run's, running
    experiment(fake_k8s, "llm-tune-3f0c2a1e", RUN)
    experiment(fake_k8s, "llm-tune-9e8d7c6b", OTHER)
    api = fake_k8s.api_client()

    said = KatibTuner(api, poll_interval_s=POLL_S).release(RUN, "default")
    said += PyTorchJobTrainer(api, poll_interval_s=POLL_S).release(RUN, "default")

    assert names(fake_k8s, "pytorchjobs") == ["llm-train-9e8d7c6b"]
    assert names(fake_k8s, "experiments") == ["llm-tune-9e8d7c6b"]
    assert said == [
        "experiment/llm-tune-3f0c2a1e in default: deleted",
        "pytorchjob/llm-fabric-3f0c2a1e in default: deleted",
        "pytorchjob/llm-train-3f0c2a1e in default: deleted",
    ]
    # by label selector (list), then by name (delete): what the Role grants
    selectors = [r.query.get("labelSelector") for r in fake_k8s.requests if r.method == "GET"]
    assert selectors == [[f"{RUN_LABEL}={RUN}"]] * 2
    assert fake_k8s.forbidden == [] and fake_k8s.errors == []


def test_a_job_already_gone_and_transient_errors_do_not_stop_the_cleanup(
    fake_k8s: FakeK8s,
) -> None:
    job(fake_k8s, "llm-train-3f0c2a1e", RUN)
    job(fake_k8s, "llm-eval-3f0c2a1e", RUN)
    fake_k8s.fail("GET", "/pytorchjobs", 503)  # the list, once
    fake_k8s.fail("DELETE", "/pytorchjobs/llm-eval-3f0c2a1e", 404)  # deleted meanwhile
    fake_k8s.fail("DELETE", "/pytorchjobs/llm-train-3f0c2a1e", 429)  # throttled, once

    said = PyTorchJobTrainer(fake_k8s.api_client()).release(RUN, "default")

    assert said == [
        "pytorchjob/llm-eval-3f0c2a1e in default: already gone",
        "pytorchjob/llm-train-3f0c2a1e in default: deleted",
    ]
    assert names(fake_k8s, "pytorchjobs") == ["llm-eval-3f0c2a1e"]  # the 404 was the fake's


def test_a_delete_that_keeps_failing_says_how_to_do_it_by_hand(fake_k8s: FakeK8s) -> None:
    job(fake_k8s, "llm-train-3f0c2a1e", RUN)
    fake_k8s.fail("DELETE", "/pytorchjobs/", 500, times=10)

    (said,) = PyTorchJobTrainer(fake_k8s.api_client()).release(RUN, "default")

    assert said.startswith("pytorchjob/llm-train-3f0c2a1e in default: deleting it failed (HTTP 500")
    assert f"kubectl delete pytorchjobs.kubeflow.org -n default -l {run_selector(RUN)}" in said


def test_the_exit_handler_deletes_the_runs_trainjobs_whatever_backend_it_is_given(
    fake_k8s: FakeK8s, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # components/summarize.py gives the exit handler no trainer_backend (it sees the default,
    # pytorchjob), yet a run with trainer_backend=trainjob left TrainJobs behind
    from kubellm import backends
    from kubellm.config import pipeline_config

    job(fake_k8s, "llm-train-3f0c2a1e", RUN)
    for name, run in (("llm-fabric-3f0c2a1e", RUN), ("llm-train-9e8d7c6b", OTHER)):
        spec = TrainJob(name=name, image="ghcr.io/example/kubellm-trainer:test", train_args=["-x"])
        fake_k8s.create_object("trainjobs", trainjob_manifest(spec, ClusterSettings(run_id=run)))
    kubeconfig = str(fake_k8s.write_kubeconfig(tmp_path / "kubeconfig"))
    # $KUBECONFIG as the kubernetes client read it at import
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    cfg = pipeline_config({"platform": "kubernetes", "namespace": "default"})
    assert cfg.trainer_backend == "pytorchjob"

    said = backends.select(cfg, RUN).release_run(champion="")

    assert "pytorchjob/llm-train-3f0c2a1e in default: deleted" in said, said
    assert "trainjob/llm-fabric-3f0c2a1e in default: deleted" in said, said
    assert names(fake_k8s, "trainjobs") == ["llm-train-9e8d7c6b"]  # another run's
    assert names(fake_k8s, "pytorchjobs") == []
    assert fake_k8s.forbidden == []


def test_a_kind_the_cluster_does_not_serve_has_nothing_to_release(fake_k8s: FakeK8s) -> None:
    fake_k8s.fail("GET", "/experiments", 404)  # Katib is not installed

    assert KatibTuner(fake_k8s.api_client()).release(RUN, "default") == []


# ---------------------------------------------------------------- InferenceServices


@dataclass
class ServeCase:
    name: str
    status: dict[str, Any] | None  # InferenceService llm's, deployed by run `run`
    champion: str | None  # the registry's champion version ("" none, None unknown)
    deleted: bool = False
    percents: tuple[Any, ...] = ()  # canaryTrafficPercent of each update sent
    says: str = ""
    run: str = RUN
    then: tuple[dict[str, Any], ...] = ()  # the statuses KServe reports next
    version: str = "2"


SERVE_CASES = [
    ServeCase("first-deployment-never-promoted", SERVING, "", deleted=True, says="removed"),
    ServeCase("first-deployment-failed", FAILED_FIRST, "1", deleted=True, says="removed"),
    ServeCase("first-deployment-still-starting", STARTING, None, deleted=True, says="removed"),
    ServeCase("the-champion", SERVING, "2", says="kept: it serves version 2, the champion"),
    ServeCase("champion-unknown-and-serving", SERVING, None, says="kept: it serves revision"),
    ServeCase(
        "a-canary-gives-its-traffic-back",
        CANARY,
        "1",
        percents=(0,),
        then=(CANARY, CANARY, ROLLED_BACK),
        says=f"traffic back on revision {REV1} (revision {REV2} gets 0%)",
    ),
    ServeCase(
        "a-canary-with-the-champion-unknown-too",
        CANARY,
        None,
        percents=(0,),
        then=(CANARY, CANARY, ROLLED_BACK),
        says=f"traffic back on revision {REV1}",
    ),
    # promoted to all traffic, but the step stopped before `champion` moved to it
    ServeCase(
        "promoted-without-the-alias",
        PROMOTED,
        "1",
        percents=(0,),
        then=(PROMOTED, PROMOTED, ROLLED_BACK),
        says=f"traffic back on revision {REV1}",
    ),
    ServeCase("another-runs-deployment", SERVING, "", run=OTHER),
]


@pytest.mark.parametrize("case", SERVE_CASES, ids=lambda c: c.name)
def test_what_the_run_deployed_and_did_not_promote_stops_serving(
    case: ServeCase, fake_k8s: FakeK8s
) -> None:
    assert case.status is not None
    stored(fake_k8s, case.status, run_tag=case.run, version=case.version)
    if case.then:
        fake_k8s.script_status("inferenceservices", "llm", list(case.then), namespace=NS)
    server = InferenceServiceServer(
        fake_k8s.api_client(), namespace=NS, poll_interval_s=POLL_S, traffic_timeout_s=5.0
    )

    said = server.release_unpromoted(RUN, case.champion)

    gone = ("inferenceservices", NS, "llm") in fake_k8s.deleted
    assert gone is case.deleted
    assert tuple(percent_sent(b) for b in puts(fake_k8s)) == case.percents
    if case.run != RUN:
        assert said == []
    else:
        (line,) = said
        assert line.startswith(f"inferenceservice/llm in {NS}") and case.says in line, line
    assert fake_k8s.forbidden == [] and fake_k8s.errors == []


def test_a_deployment_is_labelled_with_its_run_like_the_jobs() -> None:
    from kubellm.backends.kubernetes.inferenceservice import build_inferenceservice

    body = build_inferenceservice(request(run_tag=RUN))
    assert body["metadata"]["labels"][RUN_LABEL] == RUN
    assert body["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubellm"
