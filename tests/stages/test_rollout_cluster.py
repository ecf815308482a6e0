"""deploy + smoke_test on the simulated cluster: a canary is promoted on success and rolled
back on each kind of smoke-test failure (wrong answers, an HTTP error, a timeout), with the
previous revision serving throughout and `champion` unchanged.

The InferenceServices go through the fake API server (strict CRD schemas, KServe's webhook
rules) and tests/fakes/kserve_controller.py (KServe in Knative mode: revisions and the traffic
ksvc_reconciler.go derives from canaryTrafficPercent); each predictor is a real
`python -m kubellm.serve` on the chain's trained model, so the smoke test talks to real
servers. One story, in order, because each revision is a process that takes seconds to start:
v2's canary revision is created once and, after each rollback, redeployed as KServe does it
(the same template: the same revision, back at the canary's share).
"""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakes.sim_cluster import WORKSPACE_PVC, SimCluster
from kubellm.backends.base import JobFailed
from kubellm.backends.kubernetes.inferenceservice import InferenceServiceServer
from kubellm.serve.client import Endpoint, is_ready
from kubellm.stages import smoke_test
from kubellm.stages.context import StageContext
from kubellm.stages.deploy import serve_request
from kubellm.tracking import champion_of
from kubellm.tracking.registry import storage_uri
from stages.conftest import Chain, side_context

NAME = "tiny-canary"
NS = "default"


@dataclass
class Story:
    sim: SimCluster
    ctx: StageContext
    chain: Chain
    attempts: int = 0

    def deploy(self, version: str) -> Any:
        """The deploy stage's request for `version`: a copy of the model of its own (a new
        revision) the first time; again after a rollback, the same request, which KServe
        answers with the same revision at the canary's share (the template is unchanged)."""
        folder = f"v{version}"
        models = self.sim.pvc_dir(WORKSPACE_PVC) / "models"
        if not (models / folder).exists():
            shutil.copytree(self.chain.artifact("model"), models / folder)
        self.attempts += 1
        uri = f"pvc://{WORKSPACE_PVC}/models/{folder}"
        request = serve_request(self.ctx.cfg, uri, self.ctx.kfp_run_id, version)
        return self.ctx.backends.server.deploy(request)

    def predictor(self) -> dict[str, Any]:
        obj = self.sim.fake.get_object("inferenceservices", NAME, NS)
        assert obj is not None, "the InferenceService was deleted"
        return dict(obj["status"]["components"]["predictor"])

    def split(self) -> dict[str, int]:
        """revision -> percent, for targets that get traffic."""
        return {
            t["revisionName"]: t["percent"] for t in self.predictor()["traffic"] if t["percent"]
        }

    def predictions(self, **change: Any) -> Path:
        rows = json.loads(self.chain.artifact("predictions.json").read_text())
        for row in rows:
            row.update(change)
        path = self.chain.root / f"rollout-{self.attempts}.json"
        path.write_text(json.dumps(rows))
        return path


@pytest.fixture(scope="module")
def story(
    chain: Chain, ctx: StageContext, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Story]:
    client = ctx.tracker.client
    source = client.get_model_version("tiny-stage", chain.results["register"].version)
    client.create_registered_model(NAME)
    for _ in range(2):  # v1 serves first, v2 is the canary
        client.create_model_version(NAME, storage_uri(client, source), run_id=source.run_id)
    with SimCluster(tmp_path_factory.mktemp("rollout-cluster")) as sim:
        side = side_context(
            ctx,
            "rollout",
            platform="kubernetes",
            model_name=NAME,
            namespace=NS,
            canary_traffic_percent=10,
            smoke_timeout_seconds=2,
            job_timeout_minutes=2,
        )
        side.backends.__dict__["server"] = InferenceServiceServer(
            sim.api_client(), namespace=NS, poll_interval_s=0.2, traffic_timeout_s=30
        )
        yield Story(sim, side, chain)
        assert sim.errors == [] and sim.fake.errors == []
        assert sim.fake.forbidden == [], "a request the Role does not allow"


def test_first_deployment_takes_all_traffic_and_becomes_champion(story: Story) -> None:
    first = story.deploy("1")
    assert (first.canary, first.previous) == (False, "")
    result = smoke_test.run(story.ctx, first.endpoint.url, story.predictions(), "1")
    assert result.agreement == 1.0
    assert str(champion_of(story.ctx.tracker.client, NAME).version) == "1"
    assert story.split() == {f"{NAME}-predictor-00001": 100}


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("wrong answers", r"match the evaluated model on 0/\d+ prompts"),
        ("http error", r"answered 4\d\d: .*max_tokens"),
        ("timeout", r"did not answer within 2s"),
    ],
    ids=["wrong-answers", "http-error", "timeout"],
)
def test_a_failed_canary_rolls_traffic_back_to_the_previous_revision(
    story: Story, kind: str, reason: str
) -> None:
    serving = story.predictor()["latestRolledoutRevision"]
    canary = story.deploy("2")
    assert canary.canary and canary.previous == serving
    new = story.predictor()["latestReadyRevision"]
    assert new == f"{NAME}-predictor-00002", "one canary revision, redeployed after rollbacks"
    assert story.split() == {new: 10, serving: 90}, "the canary's share, the rest stays"
    assert canary.endpoint.url != story.predictor()["url"], "the canary's own address"

    pod = next(
        p["metadata"]["name"]
        for p in story.sim.fake.list_objects("pods", NS)
        if p["metadata"]["labels"].get("serving.knative.dev/revision") == new
    )
    if kind == "wrong answers":
        path = story.predictions(prediction="not what the model says")
    elif kind == "http error":
        path = story.predictions(max_new_tokens=100_000)  # beyond the server's limit: 400
    else:
        path = story.predictions()
        story.sim.kubelet.signal_pod(NS, pod, signal.SIGSTOP)  # a hung server
    try:
        with pytest.raises(JobFailed, match=reason) as failed:
            smoke_test.run(story.ctx, canary.endpoint.url, path, "2")
    finally:
        if kind == "timeout":
            story.sim.kubelet.signal_pod(NS, pod, signal.SIGCONT)
    assert f"traffic back on revision {serving}" in str(failed.value)
    assert "champion unchanged" in str(failed.value)
    assert story.split() == {serving: 100}
    assert story.predictor()["latestRolledoutRevision"] == serving
    assert is_ready(Endpoint(NAME, story.predictor()["url"])), "the previous revision serves"
    assert str(champion_of(story.ctx.tracker.client, NAME).version) == "1"
    assert story.ctx.stage_runs()["smoke_test"].info.status == "FAILED"


def test_a_passing_canary_takes_all_traffic_and_becomes_champion(story: Story) -> None:
    serving = story.predictor()["latestRolledoutRevision"]
    canary = story.deploy("2")
    new = story.predictor()["latestReadyRevision"]
    assert canary.canary and story.split() == {new: 10, serving: 90}
    result = smoke_test.run(story.ctx, canary.endpoint.url, story.predictions(), "2")
    assert result.agreement == 1.0
    assert story.split() == {new: 100}
    assert story.predictor()["latestRolledoutRevision"] == new
    assert str(champion_of(story.ctx.tracker.client, NAME).version) == "2"
    assert is_ready(Endpoint(NAME, result.endpoint))
    revisions = {
        p["metadata"]["labels"].get("serving.knative.dev/revision")
        for p in story.sim.fake.list_objects("pods", NS)
    }
    assert serving not in revisions, "the previous revision's pod is gone once promoted"
