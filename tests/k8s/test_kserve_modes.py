"""KServe's deployment modes on the simulated cluster: what Knative's validation refuses in
the Knative Service KServe builds from the predictor, seen the way KServe reports it.

Cheap: a refused predictor starts no pod. The full flows per mode (first deploy, canary,
promote, rollback) are tests/k8s/test_canary.py (Knative; kubellm's predictor passes the
masks there) and the scripted Standard cases in tests/k8s/test_inferenceservice.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from fakes.sim_cluster import WORKSPACE_PVC, SimCluster
from kubellm.backends.base import ServeRequest
from kubellm.backends.kubernetes.inferenceservice import build_inferenceservice

NS = "default"
ISVCS = ("serving.kserve.io", "v1beta1", NS, "inferenceservices")


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    with SimCluster(tmp_path_factory.mktemp("modes")) as cluster:
        yield cluster
        assert cluster.errors == [] and cluster.fake.errors == []
        assert cluster.fake.forbidden == []


def request(name: str) -> ServeRequest:
    return ServeRequest(
        name, f"pvc://{WORKSPACE_PVC}/models/v1", namespace=NS, timeout_s=10.0, run_tag="run-1"
    )


def predictor_ready(sim: SimCluster, name: str) -> dict[str, Any]:
    obj = sim.fake.get_object("inferenceservices", name, NS) or {}
    conds = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "PredictorReady"), {})


def test_a_pod_level_security_context_is_refused_in_knative_mode(sim: SimCluster) -> None:
    """What kubellm sent before (runAsUser and fsGroupChangePolicy on the pod): Knative's
    PodSpecMask refuses it, KServe reports the denial on PredictorReady, and deploy says so
    at once instead of waiting for its timeout."""
    name = "llm-pod-security"
    body = build_inferenceservice(request(name))
    body["spec"]["predictor"]["securityContext"] = {
        "runAsUser": 1000,
        "fsGroupChangePolicy": "OnRootMismatch",
    }
    api = k8s.CustomObjectsApi(sim.api_client())
    api.create_namespaced_custom_object(*ISVCS, body)
    sim.wait_for(lambda: predictor_ready(sim, name).get("reason") == "ReconcileFailed", 5)
    message = predictor_ready(sim, name)["message"]
    assert message == (
        'fails to reconcile predictor: admission webhook "validation.webhook.serving.knative.dev"'
        " denied the request: validation failed: must not set the field(s): "
        "spec.template.spec.securityContext, spec.template.spec.securityContext.runAsUser, "
        "spec.template.spec.securityContext.fsGroupChangePolicy"
    )
    assert not [p for p in sim.fake.list_objects("pods", NS) if name in p["metadata"]["name"]]
    api.delete_namespaced_custom_object(*ISVCS, name)


def test_the_deploy_step_says_when_kserve_gave_no_canary() -> None:
    """Standard mode without spec.canary: the step's traffic line says it was a full
    rollout and what it replaced."""
    from kubellm.backends.base import Rollout
    from kubellm.serve.client import Endpoint
    from kubellm.stages.deploy import _traffic

    full = Rollout(Endpoint("llm", "http://x"), previous="3", mode="Standard", full_rollout=True)
    assert "no canary" in _traffic(full, request("llm"))
    assert "replaced 3 in a full rollout" in _traffic(full, request("llm"))
    canary = Rollout(Endpoint("llm", "http://x"), canary=True, previous="llm-predictor")
    assert _traffic(canary, request("llm")).startswith("canary: 10% of traffic, 90% stays on")
