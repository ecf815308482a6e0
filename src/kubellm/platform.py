"""Pick each external system's implementation from `platform`, in one place.

Business code asks for a trainer, a tuner, a server and a workspace; only this module knows
that `local` means torchrun, optuna, a loopback ModelServer and plain directories, and that
`kubernetes` means a PyTorchJob, a Katib Experiment, an InferenceService and a shared PVC.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from pathlib import Path

from kubellm.config import PipelineConfig
from kubellm.serve.base import Server
from kubellm.train.launcher import Trainer
from kubellm.tune.base import Tuner

WORKSPACE_MOUNT = "/workspace"


class Workspace(ABC):
    """Where a step puts files that a job (another process or pod) must read or write."""

    pvc_name: str | None = None  # mounted at /workspace in job pods, when there is one

    @abstractmethod
    def dir(self, *parts: str) -> Path:
        """A directory both the step and its jobs see, created if missing."""

    @abstractmethod
    def share(self, src: str | Path, *parts: str) -> Path:
        """Make `src` visible to jobs; returns the path jobs use."""

    @abstractmethod
    def collect(self, job_path: Path, dest: str | Path) -> None:
        """Bring a job's output at `job_path` into the step's `dest` (an artifact path)."""

    @abstractmethod
    def model_uri(self, path: Path) -> str:
        """How the server backend reaches a model directory at `path`."""


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


class PvcWorkspace(LocalWorkspace):
    """A ReadWriteMany PVC mounted at /workspace in the step's pod and in every job's pods."""

    def __init__(self, pvc_name: str, run_id: str, mount: str = WORKSPACE_MOUNT) -> None:
        super().__init__(Path(mount) / run_id)  # one folder per pipeline run
        self.mount = Path(mount)
        self.pvc_name = pvc_name

    def share(self, src: str | Path, *parts: str) -> Path:
        dest = self.dir(*parts)
        shutil.copytree(src, dest, dirs_exist_ok=True)
        return dest

    def model_uri(self, path: Path) -> str:
        return f"pvc://{self.pvc_name}/{Path(path).relative_to(self.mount)}"


def workspace(cfg: PipelineConfig, kfp_run_id: str) -> Workspace:
    if cfg.platform == "local":
        return LocalWorkspace(Path(cfg.runs_dir) / "work" / kfp_run_id)
    return PvcWorkspace(cfg.workspace_pvc, kfp_run_id)


def trainer(cfg: PipelineConfig) -> Trainer:
    if cfg.platform == "local":
        from kubellm.train.torchrun import TorchrunTrainer

        return TorchrunTrainer()
    from kubellm.k8s.pytorchjob import PyTorchJobTrainer

    return PyTorchJobTrainer()


def tuner(cfg: PipelineConfig) -> Tuner:
    if cfg.platform == "local":
        from kubellm.tune.optuna_tuner import OptunaTuner

        return OptunaTuner(trainer(cfg))
    from kubellm.k8s.katib import KatibTuner

    return KatibTuner()


def server(cfg: PipelineConfig) -> Server:
    if cfg.platform == "local":
        from kubellm.serve.local import LocalModelServer

        return LocalModelServer(Path(cfg.runs_dir) / "servers")
    from kubellm.k8s.inferenceservice import InferenceServiceServer

    return InferenceServiceServer(namespace=cfg.namespace)
