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

A pipeline step's entry point is KFP's (`python -m kfp.dsl.executor_main`, which calls the
component's function and then writes the step's outputs). `end_kfp_step_fast` gives such a
process the same exit once its stage has succeeded: an atexit handler that, when the
interpreter starts to exit (the threads already joined), runs the other handlers, flushes,
and ends the process, with status 1 if an exception reached the top (KFP's writing of the
outputs failed) and 0 otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

FULL_EXIT_ENV = "KUBELLM_FULL_EXIT"
KFP_EXECUTOR = "kfp.dsl.executor_main"  # the module a KFP step's command runs


def exit_code(code: str | int | None) -> int:
    """The status `sys.exit(code)` would end the process with (None is 0, an int itself,
    anything else printed to stderr and 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _full_exit() -> bool:
    return os.environ.get(FULL_EXIT_ENV, "") not in ("", "0")


def exit_now(code: str | int | None = 0) -> NoReturn:
    """End the process with `code` (as `sys.exit` takes it) after steps 1-3 above."""
    if _full_exit():
        sys.exit(code)
    status = exit_code(code)
    _wait_for_threads()
    _finish(status)


def _finish(status: int) -> NoReturn:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or None
            stream.flush()
    os._exit(status)


def end_kfp_step_fast() -> bool:
    """In a process that KFP's executor runs (its `__main__` is kfp.dsl.executor_main),
    end it without the teardown when the interpreter exits; anywhere else (a test, the CLI,
    a notebook) do nothing. Call it once the step's work has succeeded: an exit the step
    asks for with `sys.exit(n)` afterwards would end with 0. Returns whether it is set."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if _full_exit() or getattr(spec, "name", None) != KFP_EXECUTOR:
        return False
    atexit.unregister(_step_ends)  # once, however many stages the step finished
    atexit.register(_step_ends)
    return True


def _step_ends() -> NoReturn:
    """An atexit handler (registered last, so called first): the others, then os._exit."""
    atexit.unregister(_step_ends)  # _finish runs the remaining handlers, not this one again
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    _finish(1 if uncaught is not None else 0)


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
