"""KubeClient: conditions, API rejections and waits, on the fake API server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.config import kube_config
from kubernetes.config.config_exception import ConfigException

from fakes.fake_k8s import FakeK8s
from kubellm.backends.base import JobFailed, TrainJob
from kubellm.backends.kubernetes.client import (
    KubeClient,
    condition_is_true,
    failed_condition,
    status_summary,
)
from kubellm.backends.kubernetes.pytorchjob import (
    PYTORCHJOB,
    PyTorchJobTrainer,
    pytorchjob_manifest,
)

from .conftest import POLL_S


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


def test_object_deleted_while_waited_on_is_a_failure(fake_k8s: FakeK8s) -> None:
    fake_k8s.on_create(
        "pytorchjobs", lambda fake, o: fake.fail("GET", "/pytorchjobs/gone", 404, times=99)
    )
    with pytest.raises(JobFailed, match="deleted while waited on"):
        PyTorchJobTrainer(fake_k8s.api_client(), poll_interval_s=POLL_S).run(
            TrainJob(name="gone", image="img", train_args=[], timeout_s=5)
        )


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
