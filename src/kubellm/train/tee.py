"""Copy a launcher's output, and its workers', to a file as well as to where it goes.

A Katib trial needs this: Katib's StdOut collector sends the trial container's stdout and
stderr to its metrics file (`sh -c "<cmd> 1>/var/log/katib/metrics.log 2>&1 ..."`), so
`kubectl logs` of the container is empty, and Katib deletes the trial's pods and logs when
the trial ends. With KUBELLM_LOG_DIR set (the Katib tuner sets it to a folder of the
workspace PVC) the agent appends everything printed in the container, by itself and by the
workers (which inherit its stdout and stderr), to `$KUBELLM_LOG_DIR/$KUBELLM_POD_NAME.log`,
where the tune step reads each failed trial's last lines.

It works at the file-descriptor level: fds 1 and 2 become a pipe that a thread copies to the
original stdout and to the file, so it sees what children and C libraries write too. stderr
is merged into stdout, as the collector's `2>&1` merges them anyway. A write error on the
file is ignored (the run must not fail for its log copy); one on stdout ends the copy to
stdout only.

    KUBELLM_LOG_DIR=/tmp/logs KUBELLM_POD_NAME=demo python -m kubellm.train.agent \\
        --standalone --nproc_per_node=1 -m kubellm.train.fabric --iters 2
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path
from types import TracebackType

LOG_DIR_ENV = "KUBELLM_LOG_DIR"
POD_NAME_ENV = "KUBELLM_POD_NAME"
JOIN_TIMEOUT_S = 5.0  # a stray grandchild may hold the pipe open; never wait longer


def log_path(env: dict[str, str] | None = None) -> Path | None:
    """`$KUBELLM_LOG_DIR/<pod>.log`, or None without KUBELLM_LOG_DIR. The pod's name comes
    from KUBELLM_POD_NAME (a fieldRef), else the host name (a pod's is its name)."""
    env = dict(os.environ) if env is None else env
    folder = env.get(LOG_DIR_ENV)
    if not folder:
        return None
    return Path(folder) / f"{env.get(POD_NAME_ENV) or socket.gethostname()}.log"


class Tee:
    """A context manager: while open, fds 1 and 2 also go to `path` (appended)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Tee:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # closed in __exit__
        sys.stdout.flush()
        sys.stderr.flush()
        self._stdout, self._stderr = os.dup(1), os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self._read = read
        self._thread = threading.Thread(target=self._copy, name="tee", daemon=True)
        self._thread.start()
        return self

    def _copy(self) -> None:
        to_stdout, to_file = True, True
        while chunk := os.read(self._read, 65536):
            if to_stdout:
                try:
                    _write_all(self._stdout, chunk)
                except OSError:
                    to_stdout = False
            if to_file:
                try:
                    self._file.write(chunk)
                except OSError:
                    to_file = False

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._stdout, 1)  # this process's write ends of the pipe close here
        os.dup2(self._stderr, 2)
        if self._thread is not None:
            self._thread.join(timeout=JOIN_TIMEOUT_S)  # EOF once the workers are gone too
        os.close(self._stderr)
        if self._thread is None or not self._thread.is_alive():
            os.close(self._read)
            os.close(self._stdout)
            self._file.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
