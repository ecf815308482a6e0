"""The `kubellm` command: invalid input fails before any stage starts; help is useful."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kubellm.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("train_steps=-1", ["train_steps", ">= 1"]),
        ("nope=1", ["nope", "allowed parameters"]),
        ("platform=kubernetes", ["platform='kubernetes'", "kubellm submit"]),
    ],
)
def test_run_local_rejects_bad_parameters_before_any_stage(
    override: str, names: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # a real process: exactly what a user sees, and proof that nothing ran
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubellm.cli",
            "run",
            "--local",
            "--pipeline",
            str(REPO / "pipelines" / "llm_train.yaml"),
            "--set",
            override,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for name in names:
        assert name in lines[0]
    assert not (tmp_path / "runs").exists(), "a stage started despite the invalid parameter"


def test_run_local_missing_pipeline_is_a_clear_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # run_local prepends to PATH in-process
    assert main(["run", "--local", "--pipeline", "nope.yaml"]) == 2
    assert "nope.yaml not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", ["run", "compile", "submit", "prepare", "train", "evaluate", "serve"]
)
def test_each_command_has_help(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"kubellm {command}" in out and len(out.splitlines()) > 3


def test_prepare_bad_source_is_one_line(tmp_path, capsys) -> None:
    code = main(["prepare", str(tmp_path / "ds"), "--set", f"data_source={tmp_path}/none-*.jsonl"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matches no file" in err[0]


def test_train_on_a_bad_dataset_is_one_line_with_the_cause(tmp_path: Path) -> None:
    """The workers' tracebacks go to the log file; the person gets the cause and its path."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "manifest.json").write_text("{}")
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "kubellm.cli", "train"),
            *("--dataset", str(tmp_path / "ds"), "--output", str(tmp_path / "model")),
            *("--nproc", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert "invalid dataset_dir=" in err[0] and "tokenizer/ is missing" in err[0]
    log = tmp_path / "model.train.log"
    assert f"(full log: {log})" in err[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "invalid dataset_dir=" in log.read_text()
