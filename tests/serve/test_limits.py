"""Request limits: a full queue is a 503 naming the limit, a request past its deadline stops
decoding and is a 504 naming the timeout (a stream ends with finish_reason "length").

The server's whole HTTP stack runs in-process here (kserve's app through Starlette's
TestClient), with limits too small for the shared server: a deadline that has always passed
and a queue of one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from kubellm.serve import engine as engine_module
from kubellm.serve.engine import (
    BatchEngine,
    EngineOptions,
    Event,
    Generation,
    GenerationRequest,
    SamplingParams,
)
from kubellm.serve.model import CausalLMModel
from kubellm.serve.server import BoundModelServer

CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "1+2="}]}
V2_BODY = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["1"]}]}


@pytest.fixture(scope="module")
def app_client(tiny_model_dir: Path) -> Iterator[TestClient]:
    model = CausalLMModel(
        "tiny", tiny_model_dir, options=EngineOptions(request_timeout_s=1e-9, max_queue=1)
    )
    model.load()
    BoundModelServer("127.0.0.1", 0).rest_server([model]).create_application()
    from kserve.model_server import app

    try:
        with TestClient(app) as client:
            yield client
    finally:
        model.stop()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/models/tiny:predict", {"instances": ["1+2="]}),
        ("/v2/models/tiny/infer", V2_BODY),
        ("/openai/v1/completions", {"model": "tiny", "prompt": "1+2=", "max_tokens": 3}),
        ("/openai/v1/chat/completions", CHAT_BODY),
    ],
    ids=["v1", "v2", "completions", "chat"],
)
def test_past_its_deadline_is_a_504_naming_the_timeout(
    app_client: TestClient, path: str, body: dict[str, Any]
) -> None:
    r = app_client.post(path, json=body)
    assert r.status_code == 504, r.text
    assert "request_timeout_s=" in r.text


def test_a_late_stream_ends_with_length(app_client: TestClient) -> None:
    body = {"model": "tiny", "prompt": "1+2=", "max_tokens": 3, "stream": True}
    r = app_client.post("/openai/v1/completions", json=body)
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/models/tiny:predict", {"instances": ["1+2=", "3+4="]}),
        ("/openai/v1/completions", {"model": "tiny", "prompt": ["1+2=", "3+4="]}),
    ],
    ids=["v1", "completions"],
)
def test_more_than_the_queue_holds_is_a_503_naming_the_limit(
    app_client: TestClient, path: str, body: dict[str, Any]
) -> None:
    r = app_client.post(path, json=body)
    assert r.status_code == 503, r.text
    assert "max_queue=1" in r.text


class TickingClock:
    """time.monotonic for the engine: one second per reading, so a deadline passes after a
    known number of decoding steps whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


def test_a_deadline_stops_decoding(
    in_process: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker checks each row's deadline every step: one that passes mid-decode ends the
    request there, with the tokens it had."""
    model, tokenizer = in_process
    prompt = tokenizer("12+7=", add_special_tokens=False)["input_ids"]
    engine = BatchEngine(model, tokenizer, EngineOptions(request_timeout_s=10))
    engine.start()
    try:
        (full,) = engine.generate_sync([(prompt, SamplingParams(max_tokens=40))])
        assert full.finish_reason == "length", "pick a prompt that runs to max_tokens"
        clock = TickingClock()
        monkeypatch.setattr(engine_module, "time", clock)
        done = threading.Event()
        results: list[Generation] = []

        def emit(event: Event) -> None:
            if isinstance(event, Generation):
                results.append(event)
                done.set()

        engine.submit([GenerationRequest(prompt, SamplingParams(max_tokens=40), emit)])
        assert done.wait(60)
        (late,) = results
        assert late.finish_reason == "timeout"
        # 10 s are 10 readings of the clock: one per step, a few more around them
        assert 0 < len(late.token_ids) < 40
        assert late.token_ids == full.token_ids[: len(late.token_ids)]
    finally:
        monkeypatch.undo()
        engine.stop()
