"""The local workspace: plain directories under runs_dir; every process sees every path."""

from __future__ import annotations

import shutil
from pathlib import Path

from kubellm.backends.base import Workspace


class LocalWorkspace(Workspace):
    """One machine: every process sees every path, so nothing is copied."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def dir(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def share(self, src: str | Path, *parts: str) -> Path:
        return Path(src)

    def collect(self, job_path: Path, dest: str | Path) -> None:
        if Path(job_path).resolve() != Path(dest).resolve():
            shutil.copytree(job_path, dest, dirs_exist_ok=True)

    def model_uri(self, path: Path) -> str:
        return str(path)
