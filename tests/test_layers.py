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


def test_contracts_hold_and_catch_an_upward_import(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "components", copy / "components")
    shutil.copy(REPO / "pyproject.toml", copy)
    ok = _lint(copy)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "3 kept, 0 broken" in ok.stdout

    artifact = copy / "src" / "kubellm" / "data" / "artifact.py"
    artifact.write_text(artifact.read_text() + "\nfrom kubellm.stages import context  # noqa\n")
    broken = _lint(copy)
    assert broken.returncode == 1
    assert "kubellm.data.artifact -> kubellm.stages.context" in broken.stdout
    assert "BROKEN" in broken.stdout
