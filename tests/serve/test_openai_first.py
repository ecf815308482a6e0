"""The app uvicorn serves (server.OpenAIFirst): a POST to an OpenAI route goes to its handler
directly, inside the body limit; every other request goes through the FastAPI app and its
middleware; with --latency-log everything does, so kserve's timing middleware sees it all."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Receive, Scope, Send

from kubellm.serve.model import CausalLMModel
from kubellm.serve.server import BoundModelServer, build_parser

ACCESS_LOGGER = "uvicorn.access"  # uvicorn logs each request to it
COMPLETION = {"model": "tiny", "prompt": "1+2=", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Iterator[CausalLMModel]:
    m = CausalLMModel("tiny", tiny_model_dir)
    m.load()
    try:
        yield m
    finally:
        m.stop()


def _served(model: CausalLMModel, latency_log: bool, max_body_bytes: int = 1 << 20) -> Any:
    """(the app uvicorn serves, the paths the FastAPI app's middleware saw)."""
    server = BoundModelServer(
        "127.0.0.1", 0, latency_log=latency_log, max_body_bytes=max_body_bytes
    )
    rest = server.rest_server([model])
    app = rest.create_application()
    seen: list[str] = []

    class Spy:
        def __init__(self, inner: ASGIApp) -> None:
            self.inner = inner

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                seen.append(f"{scope['method']} {scope['path']}")
            await self.inner(scope, receive, send)

    app.add_middleware(Spy)  # the stack is built at the first request
    return rest.config.app, seen


def test_openai_posts_skip_the_fastapi_stack_and_the_rest_go_through_it(
    model: CausalLMModel,
) -> None:
    served, seen = _served(model, latency_log=False)
    with TestClient(served) as client:
        r = client.post("/openai/v1/completions", json=COMPLETION)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert client.get("/openai/v1/models").status_code == 200
        assert (
            client.post("/v1/models/tiny:predict", json={"instances": ["1+2="]}).status_code == 200
        )
    assert seen == ["GET /openai/v1/models", "POST /v1/models/tiny:predict"]


def test_the_direct_path_keeps_the_body_limit_and_openais_error_shape(
    model: CausalLMModel,
) -> None:
    served, seen = _served(model, latency_log=False, max_body_bytes=1000)
    with TestClient(served) as client:
        r = client.post("/openai/v1/completions", json={**COMPLETION, "prompt": "1" * 2000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413 and "max-body-bytes" in r.json()["error"]["message"]
    assert seen == []


def test_with_the_latency_log_every_request_goes_through_the_app(model: CausalLMModel) -> None:
    served, seen = _served(model, latency_log=True)
    with TestClient(served) as client:
        assert client.post("/openai/v1/completions", json=COMPLETION).status_code == 200
    assert seen == ["POST /openai/v1/completions"]


@pytest.fixture
def access_logger() -> Iterator[logging.Logger]:
    """uvicorn's access logger, put back as it was (the server's setting is process-wide)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    handlers, propagate = list(logger.handlers), logger.propagate
    try:
        yield logger
    finally:
        logger.handlers, logger.propagate = handlers, propagate


@pytest.mark.parametrize("access_log", [True, False])
def test_no_access_log_leaves_uvicorn_no_handler_to_log_a_request_to(
    model: CausalLMModel, access_logger: logging.Logger, access_log: bool
) -> None:
    """uvicorn logs a request only while its access logger has a handler (it asks
    `hasHandlers()` per connection); --no-access-log removes them, the default keeps them."""
    access_logger.addHandler(logging.NullHandler())  # as a logging configuration gives it
    server = BoundModelServer("127.0.0.1", 0, access_log=access_log)
    rest = server.rest_server([model])
    assert rest.config.access_log is access_log
    assert access_logger.hasHandlers() is access_log
    args = build_parser().parse_args(["model", "--no-access-log"])
    assert args.access_log is False
    assert build_parser().parse_args(["model"]).access_log is True
