"""Fixtures for the serving tests: one tiny model directory and one real model server
(`kubellm serve` on 127.0.0.1, the command users run) for the whole session, plus the same
model loaded in-process to compare the served answers with."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from kubellm.serve.client import Endpoint
from kubellm.serve.generate import load_model
from serve.tiny_model import build_tiny_model

SERVER_NAME = "tiny"
READY_TIMEOUT_S = 180.0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def in_process(tiny_model_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) as evaluate loads them."""
    return load_model(tiny_model_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def server(_server_process: tuple[Endpoint, int, Path]) -> Endpoint:
    """The model server as users run it, shared by the test modules that speak HTTP to it
    (starting one takes seconds). Stopped at the end of the session, failures included."""
    return _server_process[0]


@pytest.fixture(scope="session")
def server_pid(_server_process: tuple[Endpoint, int, Path]) -> int:
    """The process id of `server` (the `kubellm serve` process itself)."""
    return _server_process[1]


@pytest.fixture(scope="session")
def server_log(_server_process: tuple[Endpoint, int, Path]) -> Path:
    """The file `server`'s output (stdout and stderr) goes to."""
    return _server_process[2]


@contextlib.contextmanager
def kubellm_serve(model_dir: Path, name: str, log_path: Path) -> Iterator[tuple[Endpoint, int]]:
    """`kubellm serve MODEL_DIR --name NAME` on a free loopback port, its output in
    `log_path`, until ready (a test failure naming its log when it exits or is not ready in
    time); stopped, with its process group, on exit, failures included."""
    port = _free_port()
    kubellm = str(Path(sys.executable).parent / "kubellm")  # this environment's entry point
    cmd = [kubellm, "serve", str(model_dir), "--name", name]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    endpoint = Endpoint(name, f"http://127.0.0.1:{port}")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"model server exited {proc.returncode}: {log_path.read_text()[-2000:]}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(endpoint.ready_url, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"model server not ready after {READY_TIMEOUT_S:.0f}s")
            time.sleep(0.1)
        yield endpoint, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def _server_process(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Endpoint, int, Path]]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with kubellm_serve(tiny_model_dir, SERVER_NAME, log_path) as (endpoint, pid):
        yield endpoint, pid, log_path
