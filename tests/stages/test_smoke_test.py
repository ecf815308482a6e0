"""stages.smoke_test: served answers must equal the evaluated ones; champion or rollback."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from fakes.http_fake import JsonHandler
from kubellm.backends.base import JobFailed, Rollout, Server, ServeRequest
from kubellm.serve.client import Endpoint, is_ready
from kubellm.stages import smoke_test
from kubellm.stages.context import StageContext
from kubellm.tracking import champion_of
from stages.conftest import Chain, side_context


def test_agreeing_answers_make_the_version_champion(chain: Chain, ctx: StageContext) -> None:
    version = chain.results["register"].version
    endpoint = chain.results["deploy"].endpoint
    result = smoke_test.run(ctx, endpoint, chain.artifact("predictions.json"), version)
    predictions = json.loads(chain.artifact("predictions.json").read_text())
    assert result.agreement == 1.0
    assert result.answer == predictions[0]["prediction"]
    assert result.metrics == {
        "agreement": 1.0,
        "served_exact_match": result.served_exact_match,
    }
    mv = ctx.tracker.client.get_model_version_by_alias("tiny-stage", "champion")
    assert str(mv.version) == version
    assert f"version {version} takes all traffic" in result.report
    assert result.report.rstrip().endswith("and is champion")


def test_answers_that_differ_only_at_near_ties_are_excused(chain: Chain, ctx: StageContext) -> None:
    """Where evaluate's top two logits were within 1e-4, a served answer may differ."""
    tied = json.loads(chain.artifact("predictions.json").read_text())
    for p in tied:
        p["prediction"] = "what a near-tie could have given"
        p["min_logit_gap"] = 5e-5
    path = chain.root / "tied-predictions.json"
    path.write_text(json.dumps(tied))
    result = smoke_test.run(ctx, chain.results["deploy"].endpoint, path, "1")
    assert result.agreement == 0.0
    assert result.near_ties == min(len(tied), smoke_test.SMOKE_PROMPTS)
    assert "near-tie(s) excused" in result.report
    # the same differences without the near-ties are failures (next test)


def test_disagreeing_answers_roll_back(chain: Chain, ctx: StageContext) -> None:
    endpoint = chain.results["deploy"].endpoint
    wrong = json.loads(chain.artifact("predictions.json").read_text())
    for p in wrong:
        p["prediction"] = "not what the model says"
    path = chain.root / "wrong-predictions.json"
    path.write_text(json.dumps(wrong))
    with pytest.raises(JobFailed, match=r"match the evaluated model on 0/\d+ prompts"):
        smoke_test.run(ctx, endpoint, path, chain.results["register"].version)
    assert not is_ready(Endpoint("tiny-stage", endpoint)), "the server was not rolled back"
    assert ctx.stage_runs()["smoke_test"].info.status == "FAILED"


class RecordingServer(Server):
    """The stage's view of a Server: records promote and rollback, serves nothing."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def deploy(self, request: ServeRequest) -> Rollout:
        raise AssertionError("the smoke test never deploys")

    def promote(self, name: str, namespace: str = "") -> Endpoint:
        self.calls.append(f"promote {name}")
        return Endpoint(name, "http://promoted")

    def rollback(self, name: str, run_tag: str = "", namespace: str = "") -> str:
        self.calls.append(f"rollback {name} {run_tag}")
        return "traffic back on revision prev-1"

    def delete(self, name: str, run_tag: str = "") -> None:
        self.calls.append(f"delete {name}")


@dataclass
class Broken:
    """A model server that answers readiness but fails completions one way."""

    status: int = 200
    delay_s: float = 0.0


@pytest.fixture
def broken_server(request: pytest.FixtureRequest) -> Iterator[str]:
    how: Broken = request.param

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            self._send(200, {"name": "tiny-stage", "ready": True})

        def do_POST(self) -> None:
            self._read_json()
            time.sleep(how.delay_s)
            body = {"choices": [{"text": "x"}]} if how.status == 200 else {}
            with contextlib.suppress(OSError):  # the client gave up (the timeout case)
                self._send(how.status, body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.parametrize(
    ("broken_server", "reason"),
    [
        (Broken(status=500), r"answered 500"),
        (Broken(status=503), r"answered 503"),
        (Broken(delay_s=3.0), r"did not answer within 1s"),
    ],
    indirect=["broken_server"],
    ids=["http-500", "http-503", "timeout"],
)
def test_each_serving_failure_rolls_back_and_keeps_the_champion(
    chain: Chain, ctx: StageContext, broken_server: str, reason: str
) -> None:
    side = side_context(ctx, "smoke-broken", smoke_timeout_seconds=1)
    recorder = RecordingServer()
    side.backends.__dict__["server"] = recorder  # the cached_property's slot
    before = champion_of(ctx.tracker.client, "tiny-stage")
    with pytest.raises(JobFailed, match=reason) as failed:
        smoke_test.run(side, broken_server, chain.artifact("predictions.json"), "1")
    assert "traffic back on revision prev-1; champion unchanged" in str(failed.value)
    assert recorder.calls == ["rollback tiny-stage smoke-broken"], "no promote, no delete"
    after = champion_of(ctx.tracker.client, "tiny-stage")
    assert (after and after.version) == (before and before.version)
    assert side.stage_runs()["smoke_test"].info.status == "FAILED"


def test_a_failed_rollback_keeps_the_reason(chain: Chain, ctx: StageContext) -> None:
    side = side_context(ctx, "smoke-rollback-fails", smoke_timeout_seconds=1)

    class Unreachable(RecordingServer):
        def rollback(self, name: str, run_tag: str = "", namespace: str = "") -> str:
            raise RuntimeError("API server unreachable")

    side.backends.__dict__["server"] = Unreachable()
    with pytest.raises(JobFailed, match=r"unreachable.*the rollback failed too: API server"):
        smoke_test.run(side, "http://127.0.0.1:9", chain.artifact("predictions.json"), "1")


def test_predictions_carry_the_near_tie_margin(chain: Chain) -> None:
    predictions = json.loads(Path(chain.artifact("predictions.json")).read_text())
    gaps = [p["min_logit_gap"] for p in predictions]
    assert all(isinstance(g, float) and g >= 0.0 for g in gaps)
