"""KubeClient: conditions, bodies, API rejections and waits, on the fake API server.

The whole lifecycle of `run` (logs, stops, retries, dropped watches) is test_job_lifecycle.py.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.config import kube_config
from kubernetes.config.config_exception import ConfigException

from fakes.fake_k8s import FakeK8s
from kubellm.backends.base import JobFailed, JobTimeout, TrainJob
from kubellm.backends.kubernetes.client import (
    SPEC_HASH_ANNOTATION,
    JobStopped,
    KubeClient,
    condition_is_true,
    failed_condition,
    prepare_body,
    spec_hash,
    status_summary,
)
from kubellm.backends.kubernetes.pytorchjob import PYTORCHJOB, pytorchjob_manifest

from .conftest import POLL_S

RUNNING = {"conditions": [{"type": "Running", "status": "True"}]}
SUCCEEDED = {
    "conditions": [
        {"type": "Running", "status": "False"},
        {"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"},
    ]
}
JOBS = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs"


def manifest(name: str = "job") -> dict[str, Any]:
    return pytorchjob_manifest(TrainJob(name=name, image="img", train_args=["--x", "1"]))


def succeeded(o: dict[str, Any]) -> bool:
    return condition_is_true(o, "Succeeded")


def open_watches(fake: FakeK8s) -> int:
    return sum(1 for r in fake.requests if r.path == JOBS and r.query.get("watch"))


def job_gets(fake: FakeK8s, name: str = "job") -> int:
    """GETs of the object itself: what a polling client would send."""
    return sum(1 for r in fake.requests if r.method == "GET" and r.path == f"{JOBS}/{name}")


def obj(*conditions: dict[str, Any]) -> dict[str, Any]:
    return {"status": {"conditions": list(conditions)}}


@dataclass
class SummaryCase:
    name: str
    obj: dict[str, Any]
    summary: str
    failed: str | None


SUMMARY_CASES = [
    SummaryCase("no-status", {}, "Pending", None),
    SummaryCase(
        "running",
        obj({"type": "Created", "status": "True"}, {"type": "Running", "status": "True"}),
        "Running",
        None,
    ),
    SummaryCase(
        "failed",
        obj(
            {"type": "Running", "status": "False"},
            {"type": "Failed", "status": "True", "reason": "R", "message": "m"},
        ),
        "Failed",
        "R: m",
    ),
    SummaryCase(
        "failed-without-reason",
        obj({"type": "Failed", "status": "True"}),
        "Failed",
        "no reason given",
    ),
    SummaryCase(
        "nothing-true",
        obj({"type": "Ready", "status": "False", "reason": "RevisionMissing"}),
        "Ready=False (RevisionMissing)",
        None,
    ),
]


@pytest.mark.parametrize("case", SUMMARY_CASES, ids=lambda c: c.name)
def test_condition_helpers(case: SummaryCase) -> None:
    assert status_summary(case.obj) == case.summary
    assert failed_condition(case.obj) == case.failed
    assert condition_is_true(case.obj, "Failed") is (case.failed is not None)


def test_rejected_body_is_a_job_failure_naming_the_field(fake_k8s: FakeK8s) -> None:
    body = pytorchjob_manifest(TrainJob(name="bad", image="img", train_args=[]))
    body["spec"]["nodes"] = 2

    with pytest.raises(JobFailed, match=r"HTTP 422 .*spec\.nodes: unknown field"):
        KubeClient(fake_k8s.api_client(), POLL_S).create(PYTORCHJOB, "default", body)

    assert fake_k8s.errors == ["pytorchjobs/bad: spec.nodes: unknown field"]


def test_object_deleted_while_waited_on_is_a_failure(
    fake_k8s: FakeK8s, play: Callable[..., None]
) -> None:
    fake_k8s.create_object("pytorchjobs", manifest("gone"))

    def story() -> None:
        deadline = time.monotonic() + 5
        while not open_watches(fake_k8s) and time.monotonic() < deadline:
            time.sleep(0.01)
        fake_k8s.delete_object("pytorchjobs", "gone")

    play(story)
    start = time.monotonic()
    with pytest.raises(JobFailed, match="pytorchjob/gone in default was deleted while waited on"):
        KubeClient(fake_k8s.api_client(), POLL_S).wait(
            PYTORCHJOB, "default", "gone", 5, done=succeeded
        )
    assert time.monotonic() - start < 3  # seen as it happened, not at the timeout


def test_wait_follows_the_watch_and_never_polls(
    fake_k8s: FakeK8s, play: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_k8s.create_object("pytorchjobs", manifest())

    def story() -> None:
        deadline = time.monotonic() + 5
        while not open_watches(fake_k8s) and time.monotonic() < deadline:
            time.sleep(0.01)
        fake_k8s.set_status("pytorchjobs", "job", RUNNING)
        fake_k8s.set_status("pytorchjobs", "job", SUCCEEDED)

    play(story)
    # A poll interval far beyond the test's length: only watch events can end it in time.
    obj = KubeClient(fake_k8s.api_client(), poll_interval_s=30).wait(
        PYTORCHJOB, "default", "job", 10, done=succeeded
    )

    assert succeeded(obj)
    assert job_gets(fake_k8s) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "pytorchjob/job: Pending",
        "pytorchjob/job: Running",
        "pytorchjob/job: Succeeded",
    ]
    assert fake_k8s.forbidden == []


def test_wait_times_out_deleting_the_object(fake_k8s: FakeK8s) -> None:
    fake_k8s.create_object("pytorchjobs", manifest())
    fake_k8s.set_status("pytorchjobs", "job", RUNNING)
    start = time.monotonic()

    with pytest.raises(JobTimeout, match=r"within 0.5s \(last state: Running\); it has been del"):
        KubeClient(fake_k8s.api_client(), POLL_S).wait(
            PYTORCHJOB, "default", "job", 0.5, done=succeeded
        )

    assert time.monotonic() - start < 2.0
    assert fake_k8s.get_object("pytorchjobs", "job") is None


def test_wait_retries_transient_errors_of_list_and_watch(
    fake_k8s: FakeK8s, play: Callable[..., None]
) -> None:
    fake_k8s.create_object("pytorchjobs", manifest())
    fake_k8s.fail("GET", "/pytorchjobs", 503, times=2)  # the list, and its first retry
    fake_k8s.fail("GET", "/pytorchjobs", 429)  # its second retry

    def until_watches(n: int) -> None:
        deadline = time.monotonic() + 5
        while open_watches(fake_k8s) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    def story() -> None:
        until_watches(1)
        fake_k8s.fail("GET", "/pytorchjobs", 500)  # the next watch
        fake_k8s.drop_watches(clean=True)
        until_watches(3)  # the one that failed, and its retry
        fake_k8s.set_status("pytorchjobs", "job", SUCCEEDED)

    play(story)
    start = time.monotonic()
    obj = KubeClient(fake_k8s.api_client(), POLL_S).wait(
        PYTORCHJOB, "default", "job", 5, done=succeeded
    )
    assert succeeded(obj) and time.monotonic() - start < 2
    lists = [r for r in fake_k8s.requests if r.path == JOBS and not r.query.get("watch")]
    assert len(lists) == 4  # three failures, then the list that worked; no list after


def test_a_hard_api_error_is_not_retried(fake_k8s: FakeK8s) -> None:
    fake_k8s.create_object("pytorchjobs", manifest())
    fake_k8s.fail("GET", "/pytorchjobs", 401)
    start = time.monotonic()
    with pytest.raises(k8s.ApiException) as info:
        KubeClient(fake_k8s.api_client(), POLL_S).wait(
            PYTORCHJOB, "default", "job", 5, done=succeeded
        )
    assert info.value.status == 401 and time.monotonic() - start < 1


def test_run_outside_the_main_thread_installs_no_signal_handler(fake_k8s: FakeK8s) -> None:
    """Python handles signals only in the main thread; run() elsewhere must still work."""
    fake_k8s.on_create("pytorchjobs", lambda f, o: f.set_status("pytorchjobs", "job", SUCCEEDED))
    results: list[Any] = []

    def worker() -> None:
        try:
            results.append(
                KubeClient(fake_k8s.api_client(), POLL_S).run(
                    PYTORCHJOB,
                    "default",
                    manifest(),
                    timeout_s=5,
                    done=succeeded,
                    echo=lambda line: None,
                )
            )
        except BaseException as e:
            results.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    (outcome,) = results
    assert not isinstance(outcome, BaseException), outcome
    assert succeeded(outcome.obj) and outcome.logs == ""


def test_run_rejected_body_fails_at_once_naming_the_field(fake_k8s: FakeK8s) -> None:
    body = manifest()
    body["spec"]["nodes"] = 2
    with pytest.raises(JobFailed, match=r"was not created: HTTP 422 .*spec\.nodes"):
        KubeClient(fake_k8s.api_client(), POLL_S).run(
            PYTORCHJOB, "default", body, timeout_s=5, done=succeeded, echo=lambda line: None
        )
    assert len(fake_k8s.created("pytorchjobs")) == 1


def test_spec_hash_is_of_the_canonical_spec() -> None:
    body = manifest()
    reordered = {**body, "spec": dict(reversed(list(body["spec"].items())))}
    relabeled = {**body, "metadata": {**body["metadata"], "labels": {"x": "y"}}}
    canonical = json.dumps(body["spec"], sort_keys=True, separators=(",", ":"))
    assert spec_hash(body) == hashlib.sha256(canonical.encode()).hexdigest()
    assert spec_hash(reordered) == spec_hash(body) == spec_hash(relabeled)
    assert spec_hash(manifest("other")) == spec_hash(body)  # the name is not the spec
    other = pytorchjob_manifest(TrainJob(name="job", image="img", train_args=["--x", "2"]))
    assert spec_hash(other) != spec_hash(body)


@dataclass
class PrepareCase:
    name: str
    env: dict[str, str]
    owned: bool
    metadata: dict[str, Any] = field(default_factory=dict)


OWNER = {
    "apiVersion": "v1",
    "kind": "Pod",
    "name": "step-pod",
    "uid": "uid-1",
    "controller": False,
    "blockOwnerDeletion": False,
}
STEP = {"KUBELLM_POD_NAME": "step-pod", "KUBELLM_POD_UID": "uid-1"}
PREPARE_CASES = [
    PrepareCase("outside-a-pipeline", {}, owned=False),
    PrepareCase("name-without-uid", {"KUBELLM_POD_NAME": "step-pod"}, owned=False),
    PrepareCase("step-pod", STEP, owned=True),
    PrepareCase("same-namespace", {**STEP, "KUBELLM_POD_NAMESPACE": "default"}, owned=True),
    # An owner in another namespace would make the garbage collector delete the job at once.
    PrepareCase("other-namespace", {**STEP, "KUBELLM_POD_NAMESPACE": "kubeflow"}, owned=False),
    PrepareCase(
        "keeps-what-the-body-has",
        STEP,
        owned=True,
        metadata={
            "labels": {"kubellm.dev/run": "r1"},
            "annotations": {"note": "kept"},
            "ownerReferences": [{**OWNER, "name": "other", "uid": "uid-0"}],
        },
    ),
]


@pytest.mark.parametrize("case", PREPARE_CASES, ids=lambda c: c.name)
def test_prepare_body_adds_the_spec_hash_and_the_step_pod_as_owner(
    case: PrepareCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("KUBELLM_POD_NAME", "KUBELLM_POD_UID", "KUBELLM_POD_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in case.env.items():
        monkeypatch.setenv(var, value)
    body = manifest()
    body["metadata"].update(json.loads(json.dumps(case.metadata)))
    sent = json.loads(json.dumps(body))

    out = prepare_body(body, "default")

    assert body == sent  # the caller's body is left as it was
    meta = out["metadata"]
    assert meta["labels"] == body["metadata"]["labels"]
    assert meta["annotations"] == {
        **(case.metadata.get("annotations") or {}),
        SPEC_HASH_ANNOTATION: spec_hash(body),
    }
    earlier = case.metadata.get("ownerReferences") or []
    assert meta.get("ownerReferences", []) == earlier + ([OWNER] if case.owned else [])
    assert out["spec"] == body["spec"]
    assert prepare_body(out, "default") == out  # preparing twice adds nothing


def test_job_stopped_exits_143_past_except_exception() -> None:
    stopped = JobStopped("pytorchjob/x in default: the step was stopped (SIGTERM)")
    assert stopped.code == 143 and str(stopped).endswith("(SIGTERM)")
    assert not isinstance(stopped, Exception)  # stage code's `except Exception` lets it by


def test_constructing_needs_no_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Neither in a cluster nor with a kubeconfig: loading one here raises ConfigException.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(
        kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "no-kubeconfig")
    )
    client = KubeClient(poll_interval_s=1.0)  # so this must not read the kubeconfig
    with pytest.raises(ConfigException, match=r"kube-config|no-kubeconfig"):  # read on first use
        _ = client.api_client
    given = k8s.ApiClient()
    assert KubeClient(given).api_client is given  # a caller's client is used as it is
    with pytest.raises(ValueError, match="poll_interval_s"):
        KubeClient(poll_interval_s=0)
