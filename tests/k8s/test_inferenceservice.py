"""InferenceServiceServer against the fake API server (schema: KServe's InferenceService CRD)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from fakes.fake_k8s import FakeK8s
from kubellm.backends.base import JobFailed, JobTimeout, ServeRequest
from kubellm.backends.kubernetes.inferenceservice import (
    InferenceServiceServer,
    build_inferenceservice,
)

from .conftest import POLL_S

URL = "http://llm.default.example.com"
ADDRESS = "http://llm-predictor.default.svc.cluster.local"
NOT_READY = {
    "conditions": [
        {"type": "PredictorReady", "status": "False", "reason": "RevisionMissing"},
        {
            "type": "Ready",
            "status": "False",
            "reason": "RevisionMissing",
            "message": 'Configuration "llm-predictor" does not have any ready Revision.',
        },
    ],
    "modelStatus": {
        "transitionStatus": "InProgress",
        "states": {"activeModelState": "Pending", "targetModelState": "Loading"},
    },
    "observedGeneration": 1,
}
READY = {
    "conditions": [
        {"type": "PredictorReady", "status": "True"},
        {"type": "Ready", "status": "True"},
    ],
    "url": URL,
    "address": {"url": ADDRESS},
    "modelStatus": {
        "transitionStatus": "UpToDate",
        "states": {"activeModelState": "Loaded", "targetModelState": "Loaded"},
    },
    "observedGeneration": 1,
}
BLOCKED = {
    "conditions": [
        {"type": "Ready", "status": "False", "reason": "RevisionFailed", "message": "crashloop"}
    ],
    "modelStatus": {
        "transitionStatus": "BlockedByFailedLoad",
        "states": {"activeModelState": "", "targetModelState": "FailedToLoad"},
        "lastFailureInfo": {
            "reason": "ModelLoadFailed",
            "message": "no config.json in /mnt/models",
        },
    },
    "observedGeneration": 1,
}


def request(**overrides: Any) -> ServeRequest:
    base: dict[str, Any] = {
        "name": "llm",
        "model_uri": "pvc://kubellm-workspace/models/llm",
        "image": "ghcr.io/example/kubellm-serve:test",
        "timeout_s": 10.0,
        "run_tag": "run-1",
    }
    return ServeRequest(**{**base, **overrides})


def server(fake: FakeK8s, **kwargs: Any) -> InferenceServiceServer:
    return InferenceServiceServer(fake.api_client(), poll_interval_s=POLL_S, **kwargs)


def test_manifest_runs_kubellm_serve_on_the_downloaded_model(fake_k8s: FakeK8s) -> None:
    body = build_inferenceservice(request())
    assert fake_k8s.validate("inferenceservices", body) == []
    predictor = body["spec"]["predictor"]
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container"
    assert container["image"] == "ghcr.io/example/kubellm-serve:test"
    assert [*container["command"], *container["args"]] == [
        "kubellm",
        "serve",
        "/mnt/models",
        "--name",
        "llm",
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
    ]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["STORAGE_URI"] == "pvc://kubellm-workspace/models/llm"
    assert predictor["securityContext"]["runAsNonRoot"] is True
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert body["metadata"]["annotations"]["kubellm/run-tag"] == "run-1"


@dataclass
class UrlCase:
    name: str
    cluster_local: bool
    status: dict[str, Any]
    url: str


URL_CASES = [
    UrlCase("external-url", False, READY, URL),
    UrlCase("cluster-local", True, READY, ADDRESS),
    UrlCase("address-only", False, {**READY, "url": None}, ADDRESS),
]


@pytest.mark.parametrize("case", URL_CASES, ids=lambda c: c.name)
def test_deploy_waits_for_ready_and_returns_the_endpoint(
    case: UrlCase, fake_k8s: FakeK8s, capsys: pytest.CaptureFixture[str]
) -> None:
    status = {k: v for k, v in case.status.items() if v is not None}
    fake_k8s.script_status("inferenceservices", "llm", [{}, NOT_READY, status])

    endpoint = server(fake_k8s, cluster_local=case.cluster_local).deploy(request())

    assert endpoint.name == "llm"
    assert endpoint.url == case.url
    assert endpoint.predict_url == f"{case.url}/v1/models/llm:predict"
    assert fake_k8s.errors == []
    out = capsys.readouterr().out
    assert "inferenceservice/llm: Ready=False (RevisionMissing" in out
    assert "inferenceservice/llm: Ready\n" in out


def test_redeploy_replaces_and_waits_for_the_new_generation(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("inferenceservices", "llm", [READY])
    srv = server(fake_k8s)
    srv.deploy(request())
    # The old Ready (generation 1) must not end the wait for generation 2. Statuses are
    # served per GET: create_or_replace reads the object once before its PUT.
    stale, fresh = READY, {**READY, "observedGeneration": 2}
    fake_k8s.script_status("inferenceservices", "llm", [stale, stale, fresh])

    srv.deploy(request(image="ghcr.io/example/kubellm-serve:v2"))

    obj = fake_k8s.get_object("inferenceservices", "llm")
    assert obj is not None and obj["metadata"]["generation"] == 2
    assert obj["spec"]["predictor"]["containers"][0]["image"].endswith(":v2")
    calls = [r.method for r in fake_k8s.requests if "/inferenceservices" in r.path]
    put = len(calls) - 1 - calls[::-1].index("PUT")
    assert calls[put + 1 :] == ["GET", "GET"]  # polled past the stale Ready
    assert fake_k8s.errors == []


def test_model_that_cannot_load_raises_with_reason(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("inferenceservices", "llm", [NOT_READY, BLOCKED])

    with pytest.raises(JobFailed, match=r"ModelLoadFailed: no config\.json") as info:
        server(fake_k8s).deploy(request())

    assert not isinstance(info.value, JobTimeout)
    assert fake_k8s.errors == []


def test_timeout_reports_why_not_ready_and_deletes(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("inferenceservices", "llm", [NOT_READY])
    start = time.monotonic()

    with pytest.raises(JobTimeout, match=r"within 0.3s.*RevisionMissing.*ready Revision"):
        server(fake_k8s).deploy(request(timeout_s=0.3))

    assert time.monotonic() - start < 3.0
    assert ("inferenceservices", "default", "llm") in fake_k8s.deleted


@dataclass
class DeleteCase:
    name: str
    run_tag: str
    deleted: bool


@pytest.mark.parametrize(
    "case",
    [
        DeleteCase("any-run", "", True),
        DeleteCase("owner-run", "run-1", True),
        DeleteCase("other-run", "run-2", False),
    ],
    ids=lambda c: c.name,
)
def test_delete_only_what_the_run_owns(case: DeleteCase, fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("inferenceservices", "llm", [READY])
    server(fake_k8s).deploy(request(run_tag="run-1"))

    server(fake_k8s).delete("llm", run_tag=case.run_tag)  # a fresh server: cleanup step

    gone = fake_k8s.get_object("inferenceservices", "llm") is None
    assert gone is case.deleted


def test_delete_of_a_missing_service_is_a_no_op(fake_k8s: FakeK8s) -> None:
    srv = server(fake_k8s, namespace="team-a")
    srv.delete("nothing-here")
    srv.delete("nothing-here", run_tag="run-1")
    assert any(
        "/namespaces/team-a/inferenceservices/nothing-here" in r.path for r in fake_k8s.requests
    )
