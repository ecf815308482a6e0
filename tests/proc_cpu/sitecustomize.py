"""Per-process CPU accounting for a suite run (DEVELOPERS.md, "The last measurement").

Put this directory first on PYTHONPATH and name a log file:

    PYTHONPATH=tests/proc_cpu KUBELLM_PROC_CPU_LOG=/tmp/procs.jsonl make test
    python tests/proc_cpu/summary.py /tmp/procs.jsonl

Every Python process that inherits the variables (most of the suite's: subprocesses copy the
environment) appends one JSON line when it ends, through atexit or os._exit (kubellm's fast
exits): its argv, own CPU seconds (user + system, not its children's), wall seconds since
start and the pytest test it ran under (PYTEST_CURRENT_TEST). A process killed by a signal
writes nothing. Inert when KUBELLM_PROC_CPU_LOG is unset.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

_LOG = os.environ.get("KUBELLM_PROC_CPU_LOG", "")
_STARTED = time.monotonic()
_written = False


def _write(how: str) -> None:
    global _written
    if _written:
        return
    _written = True
    times = os.times()
    line = {
        "pid": os.getpid(),
        "argv": [a[:300] for a in sys.argv[:12]],
        "how": how,
        "wall": round(time.monotonic() - _STARTED, 3),
        "cpu": round(times.user + times.system, 3),
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
    }
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())  # one write: lines do not interleave
    finally:
        os.close(fd)


if _LOG:
    _real_exit = os._exit

    def _exit(code: int) -> None:
        _write("os._exit")
        _real_exit(code)

    atexit.register(_write, "atexit")
    os._exit = _exit  # type: ignore[assignment]
