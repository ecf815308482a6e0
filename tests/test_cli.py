"""The `kubellm` command: invalid input fails before any stage starts; help is useful."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
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


# -- a command whose extra is not installed --------------------------------------------


@dataclass(frozen=True)
class ExtraCase:
    argv: list[str]
    extra: str
    missing: str  # the module made unimportable


EXTRA_CASES = [
    ExtraCase(["prepare", "ds"], "train", "pyarrow"),
    ExtraCase(["train", "--dataset", "ds", "--output", "m"], "train", "torch"),
    ExtraCase(["evaluate", "m", "ds"], "train", "transformers"),
    ExtraCase(["serve", "m", "--port", "0"], "serve", "torch"),
    ExtraCase(["serve", "--help"], "serve", "fastapi"),
    ExtraCase(["run", "--local"], "local", "optuna"),
    ExtraCase(["run", "--local"], "local", "sqlalchemy"),  # mlflow-skinny, not mlflow
    ExtraCase(["promote", "m@1", "--local"], "local", "torch"),
]


@pytest.mark.parametrize("case", EXTRA_CASES, ids=lambda c: f"{c.argv[0]}-{c.missing}")
def test_a_missing_extra_is_one_line_before_anything_runs(
    case: ExtraCase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, case.missing, None)  # find_spec: None, import: fails
    assert main(case.argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"kubellm {case.argv[0]}: needs the [{case.extra}] extra: "
        f"pip install 'kubellm[{case.extra}]' (No module named '{case.missing}')"
    ]
    assert list(tmp_path.iterdir()) == [], "the command started"


def test_an_import_of_a_missing_extra_module_is_one_line(tmp_path: Path) -> None:
    """The import itself fails (the probe found nothing missing): a real process, so that
    kubellm.serve.server is imported fresh, with fastapi unimportable."""
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "import kubellm.cli as cli\n"
        "cli.check_extra = lambda command, extra: None\n"
        "sys.exit(cli.main(['serve', 'm']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "kubellm serve: needs the [serve] extra: pip install 'kubellm[serve]' "
        "(No module named 'fastapi')"
    ]


@pytest.mark.parametrize(
    ("command", "name"),
    [
        ("serve", "kubellm.serve.nope"),  # our own module: a bug
        ("serve", "torch._nope"),  # a submodule of an installed package
        ("train", "yaml"),  # a core dependency, not the extra's
        ("render", "torch"),  # a core command that reached torch: a bug
    ],
)
def test_other_module_not_found_errors_keep_their_traceback(
    command: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kubellm.cli as cli

    def broken(argv: list[str]) -> int:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli, "check_extra", lambda command, extra: None)
    monkeypatch.setattr(cli, "_main", broken)
    if name == "torch":
        monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ModuleNotFoundError):
        cli.main([command])


@pytest.mark.parametrize("command", ["prepare", "train", "evaluate", "run"])
def test_help_needs_no_extra(command: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"kubellm {command}" in capsys.readouterr().out


def test_each_command_names_its_extra() -> None:
    from kubellm.cli import EXTRA_MODULES, build_parser, command_extra

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    core = {"compile", "submit", "schedule", "render", "lineage", "promote"}
    assert set(sub.choices) == core | {"run", "prepare", "train", "evaluate", "serve"}
    for command in core:
        assert command_extra(command, [command]) is None, command
    assert command_extra("promote", ["promote", "m@1", "--local"]) == "local"
    wanted = {"prepare": "train", "train": "train", "evaluate": "train", "serve": "serve"}
    for command, extra in {**wanted, "run": "local"}.items():
        assert command_extra(command, [command]) == extra
    # [local] is [train,serve] and more: what either needs, it needs
    assert set(EXTRA_MODULES["train"]) | set(EXTRA_MODULES["serve"]) < set(EXTRA_MODULES["local"])
