"""PyTorchJobTrainer against the fake API server (schemas: the Training Operator's CRD)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fakes.fake_k8s import FakeK8s
from kubellm.backends.base import JobFailed, JobTimeout, TrainJob
from kubellm.backends.kubernetes.pytorchjob import (
    PyTorchJobTrainer,
    master_selector,
    pytorchjob_manifest,
)

from .conftest import FAILED, POLL_S, RUNNING, SUCCEEDED

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
