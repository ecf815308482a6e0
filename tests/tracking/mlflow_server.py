"""A real `mlflow server` process on 127.0.0.1 for tests: sqlite backend, proxied artifacts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import requests

from kubellm.backends.local.model_server import free_port


class MlflowServerError(RuntimeError):
    """The server exited or never became healthy; the message carries its log tail."""


@dataclass(frozen=True)
class MlflowServer:
    url: str
    artifacts: Path  # --artifacts-destination: where the server stores what clients upload
    log: Path


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left (uvicorn's worker)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(grace_s)


@contextmanager
def running_mlflow_server(
    root: Path, backend_db: Path, timeout_s: float = 120.0, port: int = 0
) -> Iterator[MlflowServer]:
    """Start `mlflow server` on a loopback port (`port`, or a free one), wait for /health,
    stop it on exit."""
    port = port or free_port()
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{backend_db}",
        "--artifacts-destination",
        str(root / "art"),
        # MLflow >= 3.5 checks the Host header (DNS rebinding protection); name ours.
        "--allowed-hosts",
        f"127.0.0.1:{port},localhost:{port}",
    ]
    # The server's background job runner (huey consumers) is not needed and costs seconds.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with serving(cmd, env, root, port, timeout_s) as (url, log_path):
        yield MlflowServer(url=url, artifacts=root / "art", log=log_path)


@contextmanager
def serving(
    argv: list[str], env: dict[str, str], root: Path, port: int, timeout_s: float = 120.0
) -> Iterator[tuple[str, Path]]:
    """Run an `mlflow server` command line (its log in root/server.log), wait until its
    /health on 127.0.0.1:`port` answers 200, yield (url, log path), stop its process group
    on exit. MlflowServerError with the log's tail if it exits or never becomes healthy."""
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=root,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise MlflowServerError(f"mlflow server exited with {proc.returncode}:\n{tail}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise MlflowServerError(f"mlflow server not healthy after {timeout_s}s:\n{tail}")
            time.sleep(0.25)
        yield url, log_path
    finally:
        _stop_group(proc)
