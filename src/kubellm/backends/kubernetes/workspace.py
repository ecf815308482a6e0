"""The cluster workspace: a ReadWriteMany PVC that step pods and job pods both mount."""

from __future__ import annotations

import shutil
from pathlib import Path

from kubellm.backends.base import workspace_mount
from kubellm.backends.local.workspace import LocalWorkspace


class PvcWorkspace(LocalWorkspace):
    """A PVC mounted at WORKSPACE_MOUNT in the step's pod and in every job's pods.

    A KFP artifact lives in the step's own storage, which job pods cannot see: `share`
    copies it onto the volume, `collect` copies a job's output back.
    """

    def __init__(self, pvc_name: str, run_id: str, mount: str | None = None) -> None:
        self.mount = Path(mount or workspace_mount())
        super().__init__(self.mount / run_id)  # one folder per pipeline run
        self.pvc_name = pvc_name

    def share(self, src: str | Path, *parts: str) -> Path:
        dest = self.dir(*parts)
        shutil.copytree(src, dest, dirs_exist_ok=True)
        return dest

    def model_uri(self, path: Path) -> str:
        return f"pvc://{self.pvc_name}/{Path(path).relative_to(self.mount)}"
