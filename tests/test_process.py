"""kubellm.process.exit_now: a process that ends through it loses nothing anyone can see.

Each case is a child process: what it printed without flushing, what its non-daemon thread
and its idle thread pool did, what its atexit handler and its logging handler wrote, and its
exit status must all be there, as with the interpreter's own exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kubellm.process import exit_code

CHILD = textwrap.dedent(
    """
    import atexit, logging, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    out = Path(sys.argv[1])
    logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
    logging.info("logged")
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))

    def late() -> None:
        time.sleep(0.5)
        (out / "thread.txt").write_text("joined")

    threading.Thread(target=late).start()  # not a daemon: the exit waits for it
    pool = ThreadPoolExecutor(2)
    pool.submit(lambda: None).result()  # its workers stay idle until threading's exit hook
    sys.stdout.write("unflushed")  # a pipe: block-buffered, not yet written

    class Teardown:  # alive until module teardown, the part exit_now skips
        def __del__(self) -> None:
            (out / "teardown.txt").write_text("ran")

    kept = Teardown()
    from kubellm.process import exit_now
    exit_now(CODE)
    raise AssertionError("exit_now returned")
    """
)


def _child(
    tmp_path: Path, code: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD.replace("CODE", code))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(("code", "status"), [("0", 0), ("2", 2), ("200", 200), ("None", 0)])
def test_exit_now_keeps_output_threads_atexit_and_the_status(
    tmp_path: Path, code: str, status: int
) -> None:
    proc = _child(tmp_path, code)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "unflushed"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert "INFO:root:logged" in (tmp_path / "log.txt").read_text()
    assert "AssertionError" not in proc.stderr
    assert not (tmp_path / "teardown.txt").exists()  # the teardown was skipped


def test_a_message_exits_1_and_is_printed_as_sys_exit_does(tmp_path: Path) -> None:
    proc = _child(tmp_path, "'error: no dataset'")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: no dataset"


def test_full_exit_variable_takes_the_interpreters_own_exit(tmp_path: Path) -> None:
    proc = _child(tmp_path, "3", env={**os.environ, "KUBELLM_FULL_EXIT": "1"})
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushed" and (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "teardown.txt").read_text() == "ran"  # the interpreter's own teardown


def test_exit_code_follows_sys_exit() -> None:
    assert [exit_code(c) for c in (None, 0, 2, 256 + 5, -1)] == [0, 0, 2, 5, 255]
