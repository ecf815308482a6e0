"""The agent's output copy (kubellm/train/tee.py): a Katib trial's output must reach the
workspace file as well as the stdout Katib's collector reads, its children's included."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kubellm.train.tee import log_path

PROGRAM = textwrap.dedent(
    """
    import subprocess, sys
    from kubellm.train.tee import Tee, log_path
    with Tee(log_path()):
        print("agent: out", flush=True)
        print("agent: err", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c", "import os; os.write(1, b'worker: fd 1\\\\n'); "
                        "os.write(2, b'worker: fd 2\\\\n')"], check=True)
    print("after the tee")
    """
)


def test_everything_printed_in_the_container_reaches_stdout_and_the_file(tmp_path: Path) -> None:
    env = {"KUBELLM_LOG_DIR": str(tmp_path / "logs"), "KUBELLM_POD_NAME": "trial-master-0"}
    (tmp_path / "logs").mkdir()
    saved = tmp_path / "logs" / "trial-master-0.log"
    saved.write_text("an earlier attempt\n")  # a recreated pod appends
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env={**_base_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = ["agent: out", "agent: err", "worker: fd 1", "worker: fd 2"]
    assert proc.stdout.splitlines() == [*lines, "after the tee"]  # stderr merged, in order
    assert proc.stderr == ""
    assert saved.read_text().splitlines() == ["an earlier attempt", *lines]


def test_without_a_log_dir_there_is_no_copy() -> None:
    assert log_path({}) is None
    assert log_path({"KUBELLM_LOG_DIR": "/d", "KUBELLM_POD_NAME": "p"}) == Path("/d/p.log")


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KUBELLM_")}
