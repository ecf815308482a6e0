"""KServe's Standard (RawDeployment) mode on the simulated cluster, with the real client.

tests/fakes/kserve_controller.py runs a predictor as Deployments (one per predictor name,
spec.canary entries included), rolling pods that keep serving until their successors are
ready, with the status PropagateRawStatus reports (no revisions, no traffic). The flows:
first deploy, canary, promote and rollback with spec.canary (KServe 0.20), and first deploy,
full rollout and rollback where the CRD has no spec.canary (an older KServe). The Knative
flows on the sim are tests/k8s/test_canary.py. Each predictor is a real stand-in process, so
the stories share their sim and versions across steps.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from fakes.kserve_controller import KSERVE_CONFIG
from fakes.sim_cluster import WORKSPACE_PVC, SimCluster, crds_without_canary
from kubellm.backends.base import ServeRequest
from kubellm.backends.kubernetes.inferenceservice import (
    CLUSTER_LOCAL,
    KNATIVE_VISIBILITY_LABEL,
    KSERVE_VISIBILITY_LABEL,
    InferenceServiceServer,
    build_inferenceservice,
)
from serve.tiny_model import build_tiny_model

NS = "default"
ISVCS = ("serving.kserve.io", "v1beta1", NS, "inferenceservices")
STANDARD_DEFAULT = {"deploy": json.dumps({"defaultDeploymentMode": "Standard"})}


def _cluster(tmp: Path, crds: Path | None = None) -> SimCluster:
    cluster = SimCluster(tmp, crds=crds)
    cluster.config_maps[KSERVE_CONFIG] = dict(STANDARD_DEFAULT)
    models = cluster.pvc_dir(WORKSPACE_PVC) / "models"
    build_tiny_model(models / "v1")
    for version in ("v2", "v3"):
        shutil.copytree(models / "v1", models / version)
    (models / "broken").mkdir()
    (models / "broken" / "config.json").write_text("{}")  # no model_type: fails to load
    return cluster


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    with _cluster(tmp_path_factory.mktemp("standard")) as cluster:
        yield cluster
        assert cluster.errors == [] and cluster.fake.errors == []
        assert cluster.fake.forbidden == []


def serve(name: str, version: str) -> ServeRequest:
    return ServeRequest(
        name,
        f"pvc://{WORKSPACE_PVC}/models/{version}",
        namespace=NS,
        timeout_s=180.0,  # each version is a `kubellm serve` start-up: ~12 s, 30+ s under load
        run_tag=f"run-{version}",
        version=version,
    )


def server(sim: SimCluster) -> InferenceServiceServer:
    return InferenceServiceServer(
        sim.api_client(),
        poll_interval_s=0.2,
        traffic_timeout_s=120,  # a rollback starts the previous version's server again
        service_url=sim.kserve.service_url,
    )


def answers(url: str, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models/{name}", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def isvc(sim: SimCluster, name: str) -> dict[str, Any]:
    return sim.fake.get_object("inferenceservices", name, NS) or {}


def predictor_pods(sim: SimCluster, name: str) -> list[dict[str, Any]]:
    return [
        p
        for p in sim.fake.list_objects("pods", NS)
        if (p["metadata"].get("labels") or {}).get("serving.kserve.io/inferenceservice") == name
        and not p["metadata"].get("deletionTimestamp")
    ]


def versions(sim: SimCluster, name: str) -> set[str]:
    return {
        p["metadata"]["annotations"].get("kubellm/model-version") for p in predictor_pods(sim, name)
    }


def test_standard_mode_with_spec_canary_deploys_canaries_promotes_and_rolls_back(
    sim: SimCluster,
) -> None:
    name = "llm-std"
    srv = server(sim)
    first = srv.deploy(serve(name, "v1"))
    obj = isvc(sim, name)
    # the defaulter wrote the ConfigMap's default mode; PropagateRawStatus has no revisions
    assert obj["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    assert obj["status"]["deploymentMode"] == "Standard"
    pred = obj["status"]["components"]["predictor"]
    assert set(pred) == {"url"}
    assert (first.canary, first.mode) == (False, "Standard")
    assert answers(first.endpoint.url, name)
    (pod,) = predictor_pods(sim, name)
    labels = pod["metadata"]["labels"]
    assert labels["app"] == f"isvc.{name}-predictor" and labels["component"] == "predictor"
    assert pod["metadata"]["annotations"]["kubellm/run-tag"] == "run-v1"

    canary = srv.deploy(serve(name, "v2"))
    assert (canary.canary, canary.previous, canary.mode) == (True, f"{name}-predictor", "Standard")
    obj = isvc(sim, name)
    entry = obj["spec"]["canary"][0]["predictor"]["name"]
    assert obj["status"]["canaryStatuses"] == [{"name": entry, "ready": True, "trafficPercent": 10}]
    assert answers(canary.endpoint.url, name) and answers(first.endpoint.url, name)
    assert versions(sim, name) == {"v1", "v2"}

    promoted = srv.promote(name)
    obj = isvc(sim, name)
    assert "canaryStatuses" not in obj["status"] and obj["spec"]["predictor"]["name"] == entry
    assert not [c for c in obj["status"]["conditions"] if c["type"] == "CanaryPredictorReady"]
    sim.wait_for(lambda: versions(sim, name) == {"v2"}, 10, "the old Deployment deleted")
    assert answers(promoted.url, name)

    srv.deploy(serve(name, "v3"))
    assert versions(sim, name) == {"v2", "v3"}
    said = srv.rollback(name, "run-v3")
    assert "canary removed" in said
    sim.wait_for(lambda: versions(sim, name) == {"v2"}, 10, "the canary's Deployment deleted")

    said = srv.rollback(name, "run-v2")  # promoted: what served before comes back
    assert "version v1 restored" in said
    assert versions(sim, name) == {"v1"}
    assert answers(isvc(sim, name)["status"]["url"], name)
    srv.delete(name)


def test_a_standard_canary_that_never_serves_is_removed_and_the_stable_one_serves_on(
    sim: SimCluster,
) -> None:
    """A canary whose model cannot load never gets an available Deployment: KServe reports
    the canary not ready (no verdict on the stable predictor's modelStatus), so the deploy
    waits its timeout, then removes spec.canary; v1 serves throughout and is left as it was."""
    from kubellm.backends.base import JobTimeout

    name = "llm-std-broken"
    srv = server(sim)
    first = srv.deploy(serve(name, "v1"))
    broken = dataclasses.replace(serve(name, "broken"), timeout_s=20.0)
    with pytest.raises(JobTimeout, match=r"canary .* did not become ready within 20s") as info:
        srv.deploy(broken)
    assert "canary" not in isvc(sim, name)["spec"], str(info.value)
    sim.wait_for(lambda: versions(sim, name) == {"v1"}, 30, "the canary's Deployment deleted")
    assert answers(first.endpoint.url, name)
    assert not isvc(sim, name)["status"].get("canaryStatuses")
    assert {p["metadata"]["annotations"]["kubellm/run-tag"] for p in predictor_pods(sim, name)} == {
        "run-v1"
    }
    srv.delete(name)


def test_standard_mode_without_spec_canary_is_a_full_rollout_and_rolls_back(
    tmp_path: Path,
) -> None:
    crds = crds_without_canary(tmp_path)
    with _cluster(tmp_path / "sim", crds) as sim:
        name = "llm-old"
        srv = server(sim)
        srv.deploy(serve(name, "v1"))
        rolled = srv.deploy(serve(name, "v2"))
        assert (rolled.canary, rolled.full_rollout, rolled.previous) == (False, True, "v1")
        assert "canary" not in isvc(sim, name)["spec"]
        assert versions(sim, name) == {"v2"}
        assert answers(rolled.endpoint.url, name)
        srv.promote(name)  # nothing to move: the new version has all traffic
        said = srv.rollback(name, "run-v2")
        assert "version v1 restored" in said and versions(sim, name) == {"v1"}
        # the one refusal: the spec.canary this CRD does not know (the client then rolled out)
        assert sim.fake.errors == [f"inferenceservices/{name}: spec.canary: unknown field"]
        assert sim.errors == [] and sim.fake.forbidden == []


def test_the_defaulter_normalizes_the_mode_and_the_webhook_keeps_it(sim: SimCluster) -> None:
    """inference_service_defaults.go writes Standard for RawDeployment; an update that
    changes the mode recorded in the status is refused (validateDeploymentMode). Cheap: a
    model format no runtime serves starts no pod."""
    name = "llm-mode"
    body = build_inferenceservice(serve(name, "v1"))
    body["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] = "RawDeployment"
    body["spec"]["predictor"]["model"]["modelFormat"] = {"name": "onnx"}
    api = k8s.CustomObjectsApi(sim.api_client())
    api.create_namespaced_custom_object(*ISVCS, body)
    obj = isvc(sim, name)
    assert obj["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    sim.wait_for(lambda: isvc(sim, name).get("status", {}).get("deploymentMode"), 5)
    obj = isvc(sim, name)
    obj["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] = "Knative"
    with pytest.raises(ApiException) as err:
        api.replace_namespaced_custom_object(*ISVCS, name, obj)
    assert "deploymentMode cannot be changed from 'Standard' to 'Knative'" in str(err.value.body)
    api.delete_namespaced_custom_object(*ISVCS, name)


def test_turning_cluster_local_off_drops_the_visibility_labels() -> None:
    """_apply merges labels: without dropping them, an existing service stayed
    cluster-local after serving_cluster_local was turned off."""
    local = build_inferenceservice(
        ServeRequest("llm", "pvc://x/y", namespace=NS, cluster_local=True)
    )
    assert local["metadata"]["labels"][KNATIVE_VISIBILITY_LABEL] == CLUSTER_LOCAL
    public = build_inferenceservice(
        ServeRequest("llm", "pvc://x/y", namespace=NS, cluster_local=False)
    )
    obj = {"metadata": {**local["metadata"], "labels": {**local["metadata"]["labels"], "x": "1"}}}
    InferenceServiceServer._apply(obj, public)
    assert KNATIVE_VISIBILITY_LABEL not in obj["metadata"]["labels"]
    assert KSERVE_VISIBILITY_LABEL not in obj["metadata"]["labels"]
    assert obj["metadata"]["labels"]["x"] == "1"
