"""kubellm.process.exit_now: a process that ends through it loses nothing anyone can see.

Each case is a child process: what it printed without flushing, what its non-daemon thread
and its idle thread pool did, what its atexit handler and its logging handler wrote, and its
exit status must all be there, as with the interpreter's own exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kubellm.process import end_kfp_step_fast, exit_code

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


# A pipeline step: KFP's own executor runs the function (as the compiled YAML's command does)
STEP = textwrap.dedent(
    """
    import atexit, sys
    from pathlib import Path

    OUT = Path(__file__).parent


    class Witness:
        def __del__(self):  # runs only in the interpreter's teardown
            (OUT / "teardown.txt").write_text("ran")


    KEEP = Witness()


    def step() -> None:
        from kubellm.process import end_kfp_step_fast

        atexit.register(lambda: (OUT / "atexit.txt").write_text("ran"))
        print("set:", end_kfp_step_fast(), end="")  # not flushed
    """
)


def _kfp_step(tmp_path: Path, output_file: str, env: dict[str, str] | None = None) -> Any:
    (tmp_path / "step.py").write_text(STEP)
    executor_input = {
        "inputs": {"parameterValues": {}},
        "outputs": {"outputFile": output_file},
    }
    cmd = [sys.executable, "-m", "kfp.dsl.executor_main", "--component_module_path"]
    cmd += [str(tmp_path / "step.py"), "--function_to_execute", "step"]
    cmd += ["--executor_input", json.dumps(executor_input)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_a_kfp_step_that_succeeded_ends_without_the_teardown(tmp_path: Path) -> None:
    proc = _kfp_step(tmp_path, str(tmp_path / "out" / "output_metadata.json"))
    assert proc.returncode == 0, proc.stderr
    assert "set: True" in proc.stdout
    assert (tmp_path / "out" / "output_metadata.json").exists()  # KFP wrote its outputs
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert not (tmp_path / "teardown.txt").exists()


def test_a_kfp_step_whose_outputs_fail_to_write_still_exits_1(tmp_path: Path) -> None:
    proc = _kfp_step(tmp_path, "/dev/null/out/output_metadata.json")  # not a directory
    assert proc.returncode == 1
    assert "NotADirectoryError" in proc.stderr and "set: True" in proc.stdout
    assert (tmp_path / "atexit.txt").read_text() == "ran"


def test_the_kfp_step_exit_follows_the_full_exit_variable(tmp_path: Path) -> None:
    env = {**os.environ, "KUBELLM_FULL_EXIT": "1"}
    proc = _kfp_step(tmp_path, str(tmp_path / "out" / "output_metadata.json"), env)
    assert proc.returncode == 0 and "set: False" in proc.stdout, proc.stderr
    assert (tmp_path / "teardown.txt").read_text() == "ran"


def test_outside_a_kfp_step_nothing_is_registered() -> None:
    assert end_kfp_step_fast() is False  # pytest's own exit status must stay its own
