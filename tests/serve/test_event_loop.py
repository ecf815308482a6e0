"""The server serves on uvloop's event loop when uvloop is installed.

kserve's ModelServer, with one worker, runs `asyncio.run` itself, so uvicorn never chooses
the loop and kserve's own `event_loop` option ("auto": uvloop when available) is ignored:
before kubellm.serve.server.event_loop_factory the server ran on asyncio's selector loop
(docs/benchmarks.md, "serving after issue 20")."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import requests

from kubellm.serve.client import Endpoint
from kubellm.serve.server import event_loop_factory


def test_the_factory_makes_uvloops_loop() -> None:
    uvloop = pytest.importorskip("uvloop")  # a dependency of kserve's, via uvicorn[standard]
    factory = event_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    assert not isinstance(asyncio.new_event_loop(), uvloop.Loop)  # the default is not it


def test_the_running_server_says_it_serves_on_uvloop(server: Endpoint, server_log: Path) -> None:
    pytest.importorskip("uvloop")
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 10
    while "event loop:" not in server_log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [line for line in server_log.read_text().splitlines() if "event loop:" in line]
    assert lines, server_log.read_text()[-2000:]
    assert lines[-1].endswith("event loop: uvloop.Loop"), lines
