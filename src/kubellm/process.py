"""Ending one of kubellm's own processes without the interpreter's teardown.

A process that has imported torch and transformers spends 2-4 s of CPU after its last
statement: CPython's finalization clears thousands of modules one by one and frees their
objects, memory the operating system takes back at once anyway (measured in
docs/benchmarks.md, "Process exit"). Every training rank, torchrun agent and model server
pays it, on every start of a job, a trial or a rollout. `exit_now` keeps what finalization
does that anyone can see and skips the rest:

1. it waits for the threads that are not daemons, as the interpreter does first (after
   threading's own exit hooks, which stop idle concurrent.futures workers);
2. it runs the atexit handlers (logging's flush, MLflow's async logging queue,
   multiprocessing's clean-up, whatever a library registered);
3. it flushes stdout and stderr;
4. it ends the process with `os._exit(code)`.

What it skips: module teardown, the last garbage collection, and `__del__` of objects still
alive at that point. kubellm closes its files and joins its threads before returning, so
nothing it wrote is left in a buffer. Set KUBELLM_FULL_EXIT=1 to exit the usual way (a tool
that reports leaks at teardown needs it).

Only entry points call it (`__main__` blocks, the console script), never a function a test
or a library imports and calls.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

FULL_EXIT_ENV = "KUBELLM_FULL_EXIT"


def exit_code(code: str | int | None) -> int:
    """The status `sys.exit(code)` would end the process with (None is 0, an int itself,
    anything else printed to stderr and 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def exit_now(code: str | int | None = 0) -> NoReturn:
    """End the process with `code` (as `sys.exit` takes it) after steps 1-3 above."""
    if os.environ.get(FULL_EXIT_ENV, "") not in ("", "0"):
        sys.exit(code)
    status = exit_code(code)
    _wait_for_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or None
            stream.flush()
    os._exit(status)


def _wait_for_threads() -> None:
    """What the interpreter does first at exit: threading's own exit hooks (they tell idle
    concurrent.futures workers to stop), then a join of every thread that is not a daemon."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
