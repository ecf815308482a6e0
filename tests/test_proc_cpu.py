"""tests/proc_cpu (DEVELOPERS.md's per-process CPU accounting): each Python process that
inherits its PYTHONPATH and log variable leaves one line, whether it ends normally or through
os._exit, and the summary adds them up by kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from proc_cpu.summary import kind, summarize

HOOK = Path(__file__).resolve().parent / "proc_cpu"


def _python(code: str, log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(HOOK), "KUBELLM_PROC_CPU_LOG": str(log)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_each_process_logs_one_line_at_exit_and_at_os_exit(tmp_path: Path) -> None:
    log = tmp_path / "procs.jsonl"
    _python("sum(range(3_000_000))", log)
    _python("import os; os._exit(0)", log)
    lines = [json.loads(t) for t in log.read_text().splitlines()]
    assert [line["how"] for line in lines] == ["atexit", "os._exit"]
    assert lines[0]["argv"] == ["-c"] and lines[0]["cpu"] > 0 and lines[0]["wall"] > 0


def test_without_the_log_variable_it_writes_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBELLM_PROC_CPU_LOG"}
    env["PYTHONPATH"] = str(HOOK)
    subprocess.run([sys.executable, "-c", "pass"], env=env, cwd=tmp_path, check=True, timeout=60)
    assert list(tmp_path.iterdir()) == []


def test_the_summary_adds_cpu_by_kind() -> None:
    def line(argv: list[str], cpu: float) -> dict:
        return {"argv": argv, "cpu": cpu, "test": "tests/t.py::test_x (call)"}

    step = ["/v/kfp/dsl/executor_main.py", "--function_to_execute", "train"]
    rank = ["/src/kubellm/train/__main__.py", "--config", "/tmp/c.json"]
    assert kind(step) == "KFP pipeline steps" and kind(rank) == "training ranks"
    assert kind(["/src/kubellm/serve/__main__.py", "/m", "--name", "x"]) == "model servers"
    text = summarize([line(step, 2.0), line(rank, 3.0), line(rank, 5.0)], tests=5)
    assert "3 processes, 10 CPU-s" in text
    assert "| training ranks | 2 | 8 | 80 % |" in text
    assert "10.0  tests/t.py::test_x" in text
