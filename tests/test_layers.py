"""The layering (docs/architecture.md) is enforced by import-linter's contracts in
pyproject.toml, which `make lint` runs: imports point down only, the domain library never
imports stages or backends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    return subprocess.run(
        [str(LINT), "--no-cache", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "components", copy / "components")
    shutil.copy(REPO / "pyproject.toml", copy)
    return copy


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")


def test_contracts_hold_and_catch_an_upward_import(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    ok = _lint(copy)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "5 kept, 0 broken" in ok.stdout

    _append(copy / "src" / "kubellm" / "data" / "artifact.py", "from kubellm.stages import context")
    broken = _lint(copy)
    assert broken.returncode == 1
    assert "kubellm.data.artifact -> kubellm.stages.context" in broken.stdout
    assert "BROKEN" in broken.stdout


def test_contracts_catch_a_cycle_and_torch_in_the_core(tmp_path: Path) -> None:
    """The two contracts the install extras rest on (issue 23): no import cycle inside a
    package (pod_logs and client imported each other), and the core install's modules (the
    KFP client here) import nothing of the [train]/[serve] extras, in a function or not."""
    copy = _copy(tmp_path)
    kube = copy / "src" / "kubellm" / "backends" / "kubernetes"
    _append(kube / "pod_logs.py", "from kubellm.backends.kubernetes import client")
    _append(copy / "src" / "kubellm" / "kfp" / "client.py", "import torch")
    broken = _lint(copy)
    assert broken.returncode == 1
    assert "3 kept, 2 broken" in broken.stdout, broken.stdout
    assert "No cycles are allowed in kubellm.backends.kubernetes" in broken.stdout
    assert "kubellm.kfp.client -> torch" in broken.stdout
