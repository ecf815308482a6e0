"""Canary rollouts on the simulated cluster: real predictor processes behind KServe's status.

tests/fakes/kserve_controller.py is KServe in Knative mode: revisions, the traffic that
ksvc_reconciler.go derives from canaryTrafficPercent, and the status that
inference_service_status.go PropagateStatus reports. Each predictor is a real
`python -m kubellm.serve` (the stand-in for KServe's Hugging Face runtime) or `kubellm serve`
(our image) on a tiny model, so "still serving" is a process answering its readiness route.
The flows here are those of tests/k8s/test_inferenceservice.py, end to end; a predictor
takes a few seconds to start, so each story shares its revisions across its steps.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client as k8s

from fakes.kserve_controller import RUNTIME_CONTAINER_ANNOTATION
from fakes.sim_cluster import WORKSPACE_PVC, SimCluster
from kubellm.backends.base import JobFailed, JobTimeout, ServeRequest
from kubellm.backends.kubernetes.inferenceservice import InferenceServiceServer
from serve.tiny_model import build_tiny_model

NS = "default"
ISVCS = ("serving.kserve.io", "v1beta1", NS, "inferenceservices")


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    """One cluster with model versions v1..v3 (the same tiny model) and one that cannot load
    in the workspace PVC."""
    with SimCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        models = cluster.pvc_dir(WORKSPACE_PVC) / "models"
        build_tiny_model(models / "v1")
        for version in ("v2", "v3"):
            shutil.copytree(models / "v1", models / version)
        (models / "broken").mkdir()
        (models / "broken" / "config.json").write_text("{}")  # no model_type: fails to load
        yield cluster
        assert cluster.errors == []
        assert cluster.fake.errors == []
        assert cluster.fake.forbidden == []  # the Role in manifests/base/rbac.yaml sufficed


def serve(name: str, version: str, **overrides: Any) -> ServeRequest:
    base: dict[str, Any] = {
        "model_uri": f"pvc://{WORKSPACE_PVC}/models/{version}",
        "namespace": NS,
        "image": "ghcr.io/kubellm/serving:test",
        "timeout_s": 60.0,
        "run_tag": f"run-{version}",
        "version": version,
    }
    return ServeRequest(name, **{**base, **overrides})


def server(sim: SimCluster) -> InferenceServiceServer:
    """A fresh server, as each pipeline step has (cluster-local addresses by default)."""
    return InferenceServiceServer(sim.api_client(), poll_interval_s=0.2, traffic_timeout_s=30)


def answers(url: str, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models/{name}", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def predictor(sim: SimCluster, name: str) -> dict[str, Any]:
    obj = sim.fake.get_object("inferenceservices", name, NS) or {}
    return dict(((obj.get("status") or {}).get("components") or {}).get("predictor") or {})


def traffic(sim: SimCluster, name: str) -> list[tuple[str, str, int]]:
    """(tag, revision, percent) of each target."""
    return [
        (t.get("tag", ""), t["revisionName"], t["percent"])
        for t in predictor(sim, name).get("traffic") or []
    ]


def tag_urls(sim: SimCluster, name: str) -> dict[str, str]:
    return {t["tag"]: t["url"] for t in predictor(sim, name).get("traffic") or [] if "url" in t}


def pods(sim: SimCluster, name: str) -> dict[str, dict[str, Any]]:
    """The predictor pods of `name`, by revision."""
    return {
        p["metadata"]["labels"]["serving.knative.dev/revision"]: p
        for p in sim.fake.list_objects("pods", NS)
        if p["metadata"]["labels"].get("serving.kserve.io/inferenceservice") == name
    }


def revision(name: str, n: int) -> str:
    return f"{name}-predictor-{n:05d}"


def test_a_canary_beside_the_serving_revision_is_promoted(sim: SimCluster) -> None:
    name = "llm-a"
    rev1, rev2 = revision(name, 1), revision(name, 2)

    # first deploy (our image, runtime custom): created, all traffic, the service's address
    first = server(sim).deploy(serve(name, "v1", runtime="custom"))
    assert (first.canary, first.previous) == (False, "")
    assert answers(first.endpoint.url, name)
    assert traffic(sim, name) == [("latest", rev1, 100)]
    assert predictor(sim, name)["latestRolledoutRevision"] == rev1

    # second deploy (KServe's Hugging Face runtime): a canary with 10%, rev1 keeps 90%
    canary = server(sim).deploy(serve(name, "v2"))
    assert (canary.canary, canary.previous) == (True, rev1)
    assert traffic(sim, name) == [("latest", rev2, 10), ("prev", rev1, 90)]
    status = predictor(sim, name)
    assert (status["latestReadyRevision"], status["latestRolledoutRevision"]) == (rev2, rev1)
    urls = tag_urls(sim, name)
    assert canary.endpoint.url == urls["latest"] != urls["prev"]  # the new revision's own
    assert answers(canary.endpoint.url, name)
    assert answers(urls["prev"], name)  # the previous revision still serves
    running = pods(sim, name)
    assert set(running) == {rev1, rev2}
    # what KServe would have run: the runtime's args, then ours (MergeRuntimeContainers)
    real = json.loads(running[rev2]["metadata"]["annotations"][RUNTIME_CONTAINER_ANNOTATION])
    assert real["image"] == "kserve/huggingfaceserver:latest"
    assert real["args"] == [f"--model_name={name}", f"--model_name={name}", "--backend=huggingface"]

    # promote: all traffic to rev2, rolled out; rev1 is scaled away
    endpoint = server(sim).promote(name, NS)
    assert traffic(sim, name) == [("latest", rev2, 100)]
    status = predictor(sim, name)
    assert (status["latestRolledoutRevision"], status["previousRolledoutRevision"]) == (rev2, rev1)
    assert status["latestCreatedRevision"] == rev2  # a share change made no revision
    assert endpoint.url == tag_urls(sim, name)["latest"]  # the sim's route: rev2's process
    assert answers(endpoint.url, name)
    sim.wait_for(lambda: set(pods(sim, name)) == {rev2}, 10, "rev1's pod gone")
    sim.wait_for(lambda: not answers(urls["prev"], name), 10, "rev1's process stopped")

    # Knative refuses a traffic percent above 100: PredictorReady False, nothing else moves
    api = k8s.CustomObjectsApi(sim.api_client())
    obj = api.get_namespaced_custom_object(*ISVCS, name)
    obj["spec"]["predictor"]["canaryTrafficPercent"] = 150
    api.replace_namespaced_custom_object(*ISVCS, name, obj)

    def refused() -> bool:
        o = sim.fake.get_object("inferenceservices", name, NS) or {}
        cond = next(c for c in o["status"]["conditions"] if c["type"] == "PredictorReady")
        return cond.get("reason") == "ReconcileFailed"

    sim.wait_for(refused, 5, "ReconcileFailed")
    assert traffic(sim, name) == [("latest", rev2, 100)]
    assert predictor(sim, name)["latestCreatedRevision"] == rev2
    api.delete_namespaced_custom_object(*ISVCS, name)


def test_a_failed_canary_leaves_the_previous_revision_serving(
    sim: SimCluster,
) -> None:
    name = "llm-b"
    rev1, rev2 = revision(name, 1), revision(name, 2)
    first = server(sim).deploy(serve(name, "v1"))
    service = first.endpoint.url

    # a canary that cannot load: 0% for it, rev1 serves throughout, nothing deleted
    with pytest.raises(JobFailed, match=rf"canary revision {rev2} failed: ModelLoadFailed") as info:
        server(sim).deploy(serve(name, "broken"))
    assert f"traffic back on revision {rev1}" in str(info.value)
    assert [(r, p) for _, r, p in traffic(sim, name)] == [(rev1, 0), (rev1, 100)]
    assert predictor(sim, name)["latestRolledoutRevision"] == rev1
    assert answers(service, name)

    # a rollback asked again changes nothing, and never deletes while rev1 serves (a
    # passing or failing canary on real servers: tests/stages/test_rollout_cluster.py; the
    # run-tag rules: the scripted RollbackCase table in test_inferenceservice.py)
    assert "traffic back on revision" in server(sim).rollback(name, "run-broken", NS)
    assert sim.fake.get_object("inferenceservices", name, NS) is not None
    assert ("inferenceservices", NS, name) not in sim.fake.deleted
    assert rev1 in pods(sim, name)
    sim.fake.delete_object("inferenceservices", name, NS)


@dataclass
class FirstFailure:
    name: str
    model_uri: str
    timeout_s: float
    error: type[JobFailed]
    match: str


FIRST_FAILURES = [
    # (a model that cannot load fails a canary above; the scripted tests have it for a first
    # deploy: starting a predictor costs seconds)
    FirstFailure("timeout", f"pvc://{WORKSPACE_PVC}/models/v1", 1.0, JobTimeout, r"within 1s"),
    # the storage initializer cannot fetch it (the sim's fetches pvc:// only): the revision
    # fails without a pod, KServe reports BlockedByFailedLoad and the Ready condition's reason
    FirstFailure(
        "model-not-fetched",
        "s3://models/llm/v1",
        60.0,
        JobFailed,
        r"BlockedByFailedLoad \(Ready=False \(RevisionFailed: .*pvc:// only",
    ),
]


@pytest.mark.parametrize("case", FIRST_FAILURES, ids=lambda c: c.name)
def test_a_first_deploy_that_never_serves_is_removed(case: FirstFailure, sim: SimCluster) -> None:
    name = f"llm-{case.name}"
    request = serve(name, "v1", model_uri=case.model_uri, timeout_s=case.timeout_s)

    with pytest.raises(case.error, match=case.match) as info:
        server(sim).deploy(request)

    assert "it has been deleted" in str(info.value)
    assert sim.fake.get_object("inferenceservices", name, NS) is None
    sim.wait_for(lambda: not pods(sim, name), 10, "its pods gone")
