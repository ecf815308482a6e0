"""The local server: the KServe ModelServer as a background process on 127.0.0.1.

The server outlives the deploy step (the smoke test calls it next), so its pid and URL are
kept in a state file under runs_dir; the pipeline's exit handler stops it by run tag.

There are no revisions or traffic splits on one machine: each deployment is its own process
on its own port, so a new version never replaces a running one. `promote` has nothing to
move, and `rollback` stops the new server (whatever served before keeps serving).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kubellm.backends.base import JobFailed, JobTimeout, Rollout, Server, ServeRequest
from kubellm.serve.client import Endpoint, is_ready


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalModelServer(Server):
    def __init__(self, state_dir: str | Path, host: str = "127.0.0.1", poll_s: float = 0.5):
        self.state_dir = Path(state_dir)
        self.host = host
        self.poll_s = poll_s

    def _state(self, name: str, run_tag: str) -> Path:
        return self.state_dir / f"{name}-{run_tag or 'manual'}.json"

    def deploy(self, request: ServeRequest) -> Rollout:
        if not Path(request.model_uri, "config.json").is_file():
            raise JobFailed(f"model_uri {request.model_uri!r} is not a local model directory")
        self.delete(request.name, request.run_tag)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        port = free_port(self.host)
        url = f"http://{self.host}:{port}"
        log_path = self._state(request.name, request.run_tag).with_suffix(".log")
        cmd = [
            sys.executable,
            "-m",
            "kubellm.serve",
            request.model_uri,
            "--name",
            request.name,
            "--host",
            self.host,
            "--port",
            str(port),
        ]
        with open(log_path, "wb") as log:
            # own session and no inherited stdout: the server must not hold the step's pipe
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        state = {"pid": proc.pid, "url": url, "name": request.name, "log": str(log_path)}
        self._state(request.name, request.run_tag).write_text(json.dumps(state))
        endpoint = Endpoint(request.name, url)
        deadline = time.monotonic() + request.timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                self._state(request.name, request.run_tag).unlink(missing_ok=True)
                raise JobFailed(
                    f"model server exited with code {proc.returncode}: " + " | ".join(tail)
                )
            if is_ready(endpoint):
                print(f"deploy: {request.name} ready at {url} (log {log_path})", flush=True)
                return Rollout(endpoint)
            time.sleep(self.poll_s)
        self.delete(request.name, request.run_tag)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise JobTimeout(
            f"model server {request.name} not ready after {request.timeout_s:.0f}s: "
            + " | ".join(tail)
        )

    def promote(self, name: str, namespace: str = "") -> Endpoint:
        """The newest local server of `name` (the one deploy just started)."""
        states = sorted(
            self.state_dir.glob(f"{name}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True
        )
        for path in states:
            state = json.loads(path.read_text())
            if state.get("name") == name:
                return Endpoint(name, str(state["url"]))
        raise JobFailed(f"no local server of {name} to promote (none under {self.state_dir})")

    def rollback(self, name: str, run_tag: str = "", namespace: str = "") -> str:
        self.delete(name, run_tag)
        return f"stopped the new local server of {name}"

    def delete(self, name: str, run_tag: str = "") -> None:
        path = self._state(name, run_tag)
        if not path.is_file():
            return
        pid = int(json.loads(path.read_text())["pid"])
        _stop(pid)
        path.unlink(missing_ok=True)
        print(f"serve: stopped {name} (pid {pid})", flush=True)

    def release(self, run_tag: str) -> int:
        """Stop every server this pipeline run started; returns how many."""
        stopped = 0
        for path in sorted(self.state_dir.glob(f"*-{run_tag}.json")):
            state = json.loads(path.read_text())
            self.delete(state["name"], run_tag)
            stopped += 1
        return stopped


def _stop(pid: int, grace_s: float = 10.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # reap it if it is our child
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
