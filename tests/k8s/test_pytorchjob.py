"""PyTorchJobTrainer against the fake API server (schemas: the Training Operator's CRD)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from fakes.fake_k8s import ApiError, FakeK8s
from kubellm.backends.base import JobFailed, JobTimeout, TrainJob
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import (
    PyTorchJobTrainer,
    RetryCount,
    master_selector,
    pytorchjob_manifest,
    pytorchjob_queued,
)

from .conftest import CREATED, FAILED, POLL_S, RUNNING, SUCCEEDED

LOG = "step=10 loss=2.5\nloss=2.0\neval_loss=1.75\nnot a metric\n"


def job(**overrides: Any) -> TrainJob:
    base: dict[str, Any] = {
        "name": "llm-train",
        "image": "ghcr.io/example/kubellm-trainer:test",
        "train_args": ["--config", "/workspace/run/train.json", "--set", "learning_rate=0.003"],
        "timeout_s": 10.0,
    }
    return TrainJob(**{**base, **overrides})


def add_master_pod(fake: FakeK8s, name: str = "llm-train", log: str = LOG) -> None:
    """The master pod the operator creates for job `name`, owned by it (controller: true),
    added when the job is created; its log is what the trainer streams."""

    def create_pod(fake: FakeK8s, job: dict[str, Any]) -> None:
        if job["metadata"]["name"] == name:
            fake.add_pod(
                "default",
                f"{name}-master-0",
                {
                    "training.kubeflow.org/job-name": name,
                    "training.kubeflow.org/replica-type": "master",
                    "training.kubeflow.org/replica-index": "0",
                    "training.kubeflow.org/job-role": "master",
                },
                log=log,
                owner=job,
                spec={"containers": [{"name": "pytorch", "image": "trainer"}]},
            )

    fake.on_create("pytorchjobs", create_pod)


def test_manifest_needs_an_image() -> None:
    with pytest.raises(ValueError, match="image is required"):
        pytorchjob_manifest(job(image=""))


def test_master_selector_uses_operator_labels() -> None:
    assert master_selector("j") == (
        "training.kubeflow.org/job-name=j,training.kubeflow.org/replica-type=master"
    )


def test_success_returns_master_logs_and_metrics(
    fake_k8s: FakeK8s, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_k8s.script_status("pytorchjobs", "llm-train", [RUNNING, RUNNING, SUCCEEDED])
    add_master_pod(fake_k8s)
    add_master_pod(fake_k8s, name="other-job", log="eval_loss=9\n")  # must not be picked

    result = PyTorchJobTrainer(fake_k8s.api_client(), poll_interval_s=POLL_S).run(job())

    assert result.name == "llm-train"
    assert result.logs == LOG
    assert result.metrics == {"step": 10.0, "loss": 2.0, "eval_loss": 1.75}
    assert fake_k8s.errors == []
    (created,) = fake_k8s.created("pytorchjobs")
    assert created["metadata"]["name"] == "llm-train"
    out = capsys.readouterr().out
    assert "pytorchjob/llm-train: Running" in out and "pytorchjob/llm-train: Succeeded" in out
    assert out.count("pytorchjob/llm-train: Running") == 1  # a line per change, not per poll


def test_success_without_master_pod_is_an_error(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("pytorchjobs", "llm-train", [SUCCEEDED])
    with pytest.raises(JobFailed, match="master pod's log could not be read"):
        PyTorchJobTrainer(fake_k8s.api_client(), poll_interval_s=POLL_S).run(job())


def test_failed_job_raises_with_reason_and_log_tail(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("pytorchjobs", "llm-train", [RUNNING, FAILED])
    add_master_pod(fake_k8s, log="loading\nRuntimeError: CUDA out of memory\n")

    with pytest.raises(JobFailed) as info:
        PyTorchJobTrainer(fake_k8s.api_client(), poll_interval_s=POLL_S).run(job())

    assert not isinstance(info.value, JobTimeout)
    msg = str(info.value)
    assert "PyTorchJobFailed" in msg and "1 Master replica(s) failed" in msg
    assert "CUDA out of memory" in msg
    assert fake_k8s.errors == []


def test_timeout_deletes_the_job(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("pytorchjobs", "llm-train", [RUNNING])
    start = time.monotonic()

    with pytest.raises(JobTimeout, match=r"pytorchjob/llm-train .*within 0.3s.*Running"):
        PyTorchJobTrainer(fake_k8s.api_client(), poll_interval_s=POLL_S).run(job(timeout_s=0.3))

    assert time.monotonic() - start < 3.0
    assert ("pytorchjobs", "default", "llm-train") in fake_k8s.deleted
    assert fake_k8s.get_object("pytorchjobs", "llm-train") is None


def test_transient_api_errors_while_polling_are_retried(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("pytorchjobs", "llm-train", [RUNNING, SUCCEEDED])
    fake_k8s.fail("GET", "/pytorchjobs/llm-train", 503, times=2)
    add_master_pod(fake_k8s)

    result = PyTorchJobTrainer(fake_k8s.api_client(), poll_interval_s=POLL_S).run(job())

    assert result.metrics["eval_loss"] == 1.75


def test_rejected_create_is_a_job_failure(fake_k8s: FakeK8s) -> None:
    fake_k8s.fail("POST", "/pytorchjobs", 422)
    with pytest.raises(JobFailed, match=r"was not created: HTTP 422 injected by the test"):
        PyTorchJobTrainer(fake_k8s.api_client(), poll_interval_s=POLL_S).run(job())


# ---------------------------------------------------------------------- retries and queues

MASTER_LABELS = {
    "training.kubeflow.org/job-name": "llm-train",
    "training.kubeflow.org/replica-type": "master",
    "training.kubeflow.org/replica-index": "0",
    "training.kubeflow.org/job-role": "master",
}
POD_SPEC = {"restartPolicy": "Never", "containers": [{"name": "pytorch", "image": "trainer"}]}


def wait_for_job(fake: FakeK8s, timeout_s: float = 5.0) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while (obj := fake.get_object("pytorchjobs", "llm-train")) is None:
        assert time.monotonic() < end, "the job was never created"
        time.sleep(0.01)
    return obj


def test_a_job_that_keeps_failing_retryably_is_deleted_after_max_restarts(
    fake_k8s: FakeK8s, play: Callable[[Callable[[], None]], None]
) -> None:
    """Training Operator release-1.9 recreates a master that exits 143 (retryable under
    ExitCode) without end, whatever backoffLimit says; the step counts the recreated pods
    and deletes the job once they pass max_restarts, naming the count and the last exit."""
    attempts: list[str] = []

    def operator() -> None:
        job = wait_for_job(fake_k8s)
        fake_k8s.set_status("pytorchjobs", "llm-train", RUNNING)
        while fake_k8s.get_object("pytorchjobs", "llm-train") is not None and len(attempts) < 8:
            pod = fake_k8s.add_pod(
                "default", "llm-train-master-0", MASTER_LABELS, "", "Running",
                owner=job, spec=POD_SPEC,
            )  # fmt: skip
            attempts.append(pod["metadata"]["uid"])
            fake_k8s.append_log("default", "llm-train-master-0", f"attempt {len(attempts)}\n")
            fake_k8s.set_pod_phase("default", "llm-train-master-0", "Failed", exit_code=143)
            time.sleep(0.2)
            with contextlib.suppress(ApiError):
                fake_k8s.delete_object("pods", "llm-train-master-0")

    play(operator)
    trainer = PyTorchJobTrainer(
        fake_k8s.api_client(), cluster=ClusterSettings(max_restarts=2), poll_interval_s=POLL_S
    )
    with pytest.raises(JobFailed) as info:
        trainer.run(job(timeout_s=4.0))

    msg = str(info.value)
    assert not isinstance(info.value, JobTimeout), msg
    assert msg.startswith(
        "pytorchjob/llm-train in default: pod llm-train-master-0 failed 3 times with retryable "
        "exits, more than job_max_restarts=2 allows (the last time: exit code 143)"
    ), msg
    assert "; it has been deleted\n--- last lines of llm-train-master-0 ---\n" in msg
    assert ("pytorchjobs", "default", "llm-train") in fake_k8s.deleted
    assert 3 <= len(set(attempts)) <= 4  # three runs, and a fourth the deletion may catch
    assert fake_k8s.errors == [] and fake_k8s.forbidden == []


def test_the_timeout_starts_when_the_job_is_admitted(
    fake_k8s: FakeK8s,
    play: Callable[[Callable[[], None]], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job Kueue holds suspended (here twice: queued, admitted, pre-empted, admitted again)
    waits longer than its timeout without the step deleting it; each admitted stretch has the
    whole timeout, as the operator's activeDeadlineSeconds does."""
    suspended = {
        "conditions": [
            CREATED,
            {"type": "Suspended", "status": "True", "reason": "PyTorchJobSuspended"},
        ]
    }
    resumed = {
        "conditions": [
            CREATED,
            {"type": "Suspended", "status": "False", "reason": "PyTorchJobResumed"},
            {"type": "Running", "status": "True", "reason": "PyTorchJobRunning"},
        ]
    }

    def set_suspend(value: bool) -> None:
        obj = wait_for_job(fake_k8s)
        obj["spec"]["runPolicy"]["suspend"] = value  # what Kueue patches
        fake_k8s.put_object("pytorchjobs", obj)
        fake_k8s.set_status("pytorchjobs", "llm-train", suspended if value else resumed)

    def kueue_and_operator() -> None:
        set_suspend(True)  # Kueue's webhook creates it suspended
        time.sleep(1.2)  # twice the timeout, queued
        set_suspend(False)
        time.sleep(0.3)
        set_suspend(True)  # pre-empted
        time.sleep(1.2)
        assert ("pytorchjobs", "default", "llm-train") not in fake_k8s.deleted
        set_suspend(False)
        fake_k8s.add_pod(
            "default", "llm-train-master-0", MASTER_LABELS, LOG,
            owner=wait_for_job(fake_k8s), spec=POD_SPEC,
        )  # fmt: skip
        fake_k8s.set_status("pytorchjobs", "llm-train", SUCCEEDED)

    play(kueue_and_operator)
    result = PyTorchJobTrainer(fake_k8s.api_client(), poll_interval_s=POLL_S).run(
        job(timeout_s=0.6)
    )

    assert result.metrics["eval_loss"] == 1.75
    out = capsys.readouterr().out
    waiting = (
        "pytorchjob/llm-train: waiting in a queue (suspended); the 0.6s timeout starts when it "
        "is admitted (it may wait 86400s)"
    )
    assert out.count(waiting) == 2, out
    admitted = r"pytorchjob/llm-train: admitted after \d+s in the queue; 0.6s from now"
    assert len(re.findall(admitted, out)) == 2, out
    assert fake_k8s.errors == []


@dataclass
class RetryCase:
    name: str
    events: list[tuple[str, dict[str, Any]]]
    count: int
    last: str = ""


def pod(
    uid: str,
    phase: str,
    code: int | None = None,
    *,
    index: str = "0",
    restart_policy: str = "Never",
    restarts: int = 0,
    deleting: bool = False,
    reason: str = "",
) -> dict[str, Any]:
    """A pod of job llm-train as the operator and the kubelet would leave it."""
    name = f"llm-train-worker-{index}"
    state: dict[str, Any] = {"running": {}}
    if code is not None:
        state = {"terminated": {"exitCode": code}}
    meta: dict[str, Any] = {
        "name": name,
        "uid": uid,
        "labels": {
            "training.kubeflow.org/replica-type": "worker",
            "training.kubeflow.org/replica-index": index,
        },
    }
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase}
    if code is not None or phase == "Running":
        status["containerStatuses"] = [
            {"name": "pytorch", "restartCount": restarts, "state": state}
        ]
    if reason:
        status["reason"] = reason
    return {"metadata": meta, "spec": {"restartPolicy": restart_policy}, "status": status}


RETRY_CASES = [
    RetryCase("retryable exit", [("ADDED", pod("a", "Failed", 143))], 1, "exit code 143"),
    RetryCase("the same failure seen twice", [
        ("ADDED", pod("a", "Failed", 200)), ("MODIFIED", pod("a", "Failed", 200)),
        ("DELETED", pod("a", "Failed", 200)),
    ], 1),
    RetryCase("a replica failing again and again", [
        ("ADDED", pod("a", "Failed", 200)), ("DELETED", pod("a", "Failed", 200)),
        ("ADDED", pod("b", "Running")), ("MODIFIED", pod("b", "Failed", 137)),
    ], 2, "exit code 137"),
    RetryCase("permanent exit: the operator fails the job", [("ADDED", pod("a", "Failed", 1))], 0),
    RetryCase("failed while being deleted (someone deleted it)",
              [("MODIFIED", pod("a", "Failed", 143, deleting=True))], 0),
    RetryCase("deleted while running (Kueue suspends the job), then recreated", [
        ("ADDED", pod("a", "Running")), ("DELETED", pod("a", "Running")),
        ("ADDED", pod("b", "Pending")),
    ], 0),
    RetryCase("replaced without its end being seen (a watch gap)", [
        ("LISTED", pod("a", "Running")), ("LISTED", pod("b", "Running")),
    ], 1, "replaced without its end being seen"),
    RetryCase("evicted: failed without an exit code", [
        ("MODIFIED", pod("a", "Failed", reason="Evicted")),
    ], 1, "no exit code, Evicted"),
    RetryCase("in-place restarts (OnFailure)", [
        ("MODIFIED", pod("a", "Running", restart_policy="OnFailure", restarts=1)),
        ("MODIFIED", pod("a", "Running", restart_policy="OnFailure", restarts=2)),
    ], 2, "restarted in place"),
    RetryCase("succeeded replicas are not retries", [
        ("ADDED", pod("a", "Succeeded", 0)), ("ADDED", pod("b", "Succeeded", 0, index="1")),
    ], 0),
    RetryCase("every replica stopped at once (a pre-emption) is one retry", [
        ("ADDED", pod("a", "Failed", 200)), ("ADDED", pod("b", "Failed", 200, index="1")),
    ], 1),
]  # fmt: skip


@pytest.mark.parametrize("case", RETRY_CASES, ids=lambda c: c.name)
def test_retry_count(case: RetryCase) -> None:
    count = RetryCount("llm-train", max_restarts=5)
    assert all(count.check(kind, obj) is None for kind, obj in case.events)
    assert count.count == case.count
    if case.last:  # one fewer allowed: the last event stops the job, saying why
        strict = RetryCount("llm-train", max_restarts=case.count - 1)
        why = [strict.check(kind, obj) for kind, obj in case.events][-1]
        assert why is not None and f"(the last time: {case.last})" in why, why


def test_retry_count_stops_the_job_on_the_failure_past_the_limit() -> None:
    count = RetryCount("llm-train", max_restarts=1)
    assert count.watch().selector == "training.kubeflow.org/job-name=llm-train"
    assert count.check("ADDED", pod("a", "Failed", 143)) is None
    why = count.check("ADDED", pod("b", "Failed", 200))
    assert why is not None and why.startswith(
        "pod llm-train-worker-0 failed 2 times with retryable exits, more than "
        "job_max_restarts=1 allows (the last time: exit code 200)"
    )


def test_queued_is_the_suspend_field_or_the_condition() -> None:
    def obj(suspend: bool | None, condition: str | None, queue: str = "") -> dict[str, Any]:
        policy = {} if suspend is None else {"suspend": suspend}
        conditions = [{"type": "Suspended", "status": condition}] if condition else []
        labels = {"kueue.x-k8s.io/queue-name": queue} if queue else {}
        return {
            "metadata": {"labels": labels},
            "spec": {"runPolicy": policy},
            "status": {"conditions": conditions},
        }

    assert pytorchjob_queued(obj(None, None)) is None
    assert pytorchjob_queued(obj(False, "False")) is None
    assert pytorchjob_queued(obj(True, None, "team-a")) == "suspended, queue team-a"
    # Kueue has unsuspended it, the operator has not resumed it yet: still waiting
    assert pytorchjob_queued(obj(False, "True")) == "suspended"
