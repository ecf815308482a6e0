"""LocalModelServer: a real KServe ModelServer process on 127.0.0.1, started and stopped.

One server is deployed for the module (starting one takes seconds); the release test stops
it and so runs last. Every process started here is stopped at teardown, failures included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from kubellm.backends.base import JobFailed, JobTimeout, ServeRequest
from kubellm.backends.local.model_server import LocalModelServer
from kubellm.serve.client import Endpoint, ask
from kubellm.serve.generate import greedy_with_margins
from serve.compare import assert_same_greedy

RUN_TAG = "t1"
PROMPTS = ["12+7=", "3+4=", "45+6=", "99+1=", "10+20="]


@dataclass(frozen=True)
class Served:
    server: LocalModelServer
    endpoint: Endpoint
    pid: int


def _listening(pid: int) -> list[Any]:
    """LISTEN sockets of the process and its children."""
    proc = psutil.Process(pid)
    out = []
    for p in [proc, *proc.children(recursive=True)]:
        conns = p.net_connections if hasattr(p, "net_connections") else p.connections
        out += [c for c in conns(kind="inet") if c.status == psutil.CONN_LISTEN]
    return out


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def _kill_leftovers(started_before: set[int], state_dir: Path | None = None) -> None:
    """Stop any server a failed test left running (state files, then our new children)."""
    pids = set()
    if state_dir is not None:
        for path in state_dir.glob("*.json"):
            pids.add(int(json.loads(path.read_text())["pid"]))
    for child in psutil.Process().children(recursive=True):
        if child.pid in started_before:
            continue
        with contextlib.suppress(psutil.Error):
            if "kubellm.serve" in " ".join(child.cmdline()):
                pids.add(child.pid)
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


@pytest.fixture
def our_children() -> Iterator[set[int]]:
    """Pids of our children before the test; any model server it leaves behind is killed."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield before
    _kill_leftovers(before)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    state_dir = tmp_path_factory.mktemp("servers")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    server = LocalModelServer(state_dir=state_dir)
    try:
        endpoint = server.deploy(
            ServeRequest(name="tiny", model_uri=str(tiny_model_dir), run_tag=RUN_TAG, timeout_s=120)
        ).endpoint
        state = json.loads((state_dir / f"tiny-{RUN_TAG}.json").read_text())
        yield Served(server, endpoint, int(state["pid"]))
    finally:
        server.release(RUN_TAG)
        _kill_leftovers(before, state_dir)


def test_deploy_returns_a_loopback_endpoint(served: Served) -> None:
    assert served.endpoint.name == "tiny"
    assert served.endpoint.url.startswith("http://127.0.0.1:")
    assert served.endpoint.predict_url == f"{served.endpoint.url}/v1/models/tiny:predict"
    assert _alive(served.pid)


def test_model_reports_ready(served: Served) -> None:
    r = requests.get(f"{served.endpoint.url}/v1/models/tiny", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"name": "tiny", "ready": True}
    assert requests.get(f"{served.endpoint.url}/v1/models/other", timeout=10).status_code == 404


def test_predictions_match_in_process_completion(
    served: Served, in_process: tuple[Any, Any]
) -> None:
    budgets = [6, 2, 6, 4, 6]
    body = {
        "instances": [
            {"prompt": p, "max_new_tokens": n} for p, n in zip(PROMPTS, budgets, strict=True)
        ]
    }
    r = requests.post(served.endpoint.predict_url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    assert len(predictions) == len(PROMPTS)
    model, tokenizer = in_process
    # each instance keeps its own max_new_tokens
    expected = [
        greedy_with_margins(model, tokenizer, [p], n)[0]
        for p, n in zip(PROMPTS, budgets, strict=True)
    ]
    assert_same_greedy(predictions, expected, "predictions")
    # plain string instances take the default of 8 new tokens
    r = requests.post(served.endpoint.predict_url, json={"instances": PROMPTS[:2]}, timeout=60)
    assert r.status_code == 200, r.text
    expected = greedy_with_margins(model, tokenizer, PROMPTS[:2], 8)
    assert_same_greedy(r.json()["predictions"], expected, "default budget")


def test_the_smoke_test_client_gets_the_in_process_answers(
    served: Served, in_process: tuple[Any, Any]
) -> None:
    """kubellm.serve.client speaks the OpenAI completions route (what the smoke test uses)."""
    answers = ask(served.endpoint, PROMPTS, max_new_tokens=6)
    assert_same_greedy(answers, greedy_with_margins(*in_process, PROMPTS, 6), "client.ask")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"instances": []}, "1 to 256 items"),
        ({"inputs": ["1+2="]}, '"instances" list'),
        (
            {"instances": [{"text": "1+2="}]},
            'instances[0] must be a string or have a string "prompt"',
        ),
        ({"instances": [{"prompt": "1+2=", "max_new_tokens": 10_000}]}, "max_new_tokens"),
        ({"instances": ["1+2=", ""]}, "instances[1].prompt is empty"),
    ],
    ids=["empty", "no-instances", "no-prompt", "max-new-tokens", "empty-prompt"],
)
def test_bad_payload_is_a_400_naming_why(served: Served, body: Any, reason: str) -> None:
    r = requests.post(served.endpoint.predict_url, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]


def test_listens_on_loopback_only(served: Served) -> None:
    sockets = _listening(served.pid)
    port = int(served.endpoint.url.rsplit(":", 1)[1])
    assert [(c.laddr.ip, c.laddr.port) for c in sockets] == [("127.0.0.1", port)]


def test_deploy_refuses_a_directory_that_is_not_a_model(
    tmp_path: Path, our_children: set[int]
) -> None:
    (tmp_path / "model").mkdir()
    server = LocalModelServer(state_dir=tmp_path / "servers")
    with pytest.raises(JobFailed, match="is not a local model directory"):
        server.deploy(ServeRequest(name="bad", model_uri=str(tmp_path / "model"), run_tag="t2"))
    assert list((tmp_path / "servers").glob("*.json")) == []
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in our_children]
    assert new == []


def test_server_that_cannot_start_fails_with_its_log(
    tmp_path: Path, tiny_model_dir: Path, our_children: set[int]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text("{ not json")
    server = LocalModelServer(state_dir=tmp_path / "servers")
    timeout_s = 90.0
    start = time.monotonic()
    try:
        with pytest.raises(JobFailed) as info:
            server.deploy(
                ServeRequest(
                    name="broken", model_uri=str(broken), run_tag="t3", timeout_s=timeout_s
                )
            )
    finally:
        _kill_leftovers(our_children, tmp_path / "servers")
    assert time.monotonic() - start < timeout_s
    assert not isinstance(info.value, JobTimeout)  # it saw the exit, it did not wait it out
    message = str(info.value)
    assert "model server exited with code 1" in message
    assert "not a valid JSON file" in message  # the log tail says why
    assert not (tmp_path / "servers" / "broken-t3.json").exists()


def test_server_not_ready_in_time_is_stopped(
    tmp_path: Path, tiny_model_dir: Path, our_children: set[int]
) -> None:
    server = LocalModelServer(state_dir=tmp_path / "servers", poll_s=0.05)
    try:
        with pytest.raises(JobTimeout, match="not ready after"):
            server.deploy(
                ServeRequest(
                    name="slow", model_uri=str(tiny_model_dir), run_tag="t4", timeout_s=0.3
                )
            )
        new = [p for p in psutil.Process().children(recursive=True) if p.pid not in our_children]
        assert [p.pid for p in new if _alive(p.pid)] == []
        assert not (tmp_path / "servers" / "slow-t4.json").exists()
    finally:
        _kill_leftovers(our_children, tmp_path / "servers")


def test_release_stops_the_server(served: Served) -> None:
    """Runs last in this module: it stops the shared server."""
    assert served.server.release("other-run") == 0
    assert _alive(served.pid)
    assert served.server.release(RUN_TAG) == 1
    assert not _alive(served.pid)
    assert not _port_open(served.endpoint.url)
    assert served.server.release(RUN_TAG) == 0
    served.server.delete("tiny", RUN_TAG)  # idempotent
