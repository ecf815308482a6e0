"""Pick each external system's implementation from `platform`, in one place.

Stages ask for a trainer, a tuner, a server and a workspace; only this module knows that
`local` means torchrun, optuna, a loopback ModelServer and plain directories, and that
`kubernetes` means a PyTorchJob (or, with `trainer_backend=trainjob`, a Trainer v2
TrainJob), a Katib Experiment, an InferenceService and a shared PVC, and that `slurm` is
`local` with the training jobs sent to Slurm as sbatch jobs, and a search's trials as one
array job, from the login node the steps run on (runs_dir on a filesystem the compute nodes
share).
The implementations are imported on first use, so a local run never loads the Kubernetes
SDKs and a cluster step never imports optuna.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from kubellm.backends.base import Server, Trainer, Tuner, Workspace
from kubellm.config import PipelineConfig
from kubellm.redact import redact

if TYPE_CHECKING:
    from kubellm.backends.kubernetes.podspec import ClusterSettings
    from kubellm.backends.slurm.script import SlurmSettings


@dataclass(frozen=True)
class Tracking:
    """Where MLflow keeps this platform's artifacts, and how a person opens the UI."""

    artifact_location: str | None  # None: the tracking server's default
    ui_hint: str


class Backends:
    """The trainer, tuner, server, workspace and tracking settings of one platform."""

    def __init__(self, cfg: PipelineConfig, kfp_run_id: str) -> None:
        self.cfg = cfg
        self.kfp_run_id = kfp_run_id
        # This machine's files, servers and tracking: `local`, and `slurm` but for training.
        self.local = cfg.platform != "kubernetes"

    @cached_property
    def workspace(self) -> Workspace:
        if self.local:
            from kubellm.backends.local.workspace import LocalWorkspace

            return LocalWorkspace(Path(self.cfg.runs_dir) / "work" / self.kfp_run_id)
        from kubellm.backends.kubernetes.workspace import PvcWorkspace

        return PvcWorkspace(self.cfg.workspace_pvc, self.kfp_run_id)

    @cached_property
    def cluster_settings(self) -> ClusterSettings:
        """Resources, placement and fabric of this run's job pods (cluster only)."""
        from kubellm.backends.kubernetes.podspec import ClusterSettings

        return ClusterSettings.from_config(self.cfg, self.kfp_run_id)

    @cached_property
    def slurm_settings(self) -> SlurmSettings:
        """Resources, placement, fabric and work directory of this run's Slurm jobs."""
        from kubellm.backends.slurm.script import SlurmSettings

        return SlurmSettings.from_config(self.cfg, self.kfp_run_id)

    @cached_property
    def trainer(self) -> Trainer:
        if self.cfg.platform == "slurm":
            from kubellm.backends.slurm.trainer import SlurmTrainer

            return SlurmTrainer(self.slurm_settings)
        if self.local:
            from kubellm.backends.local.torchrun import TorchrunTrainer

            return TorchrunTrainer()
        if self.cfg.trainer_backend == "trainjob":
            from kubellm.backends.kubernetes.trainjob import TrainJobTrainer

            return TrainJobTrainer(cluster=self.cluster_settings)
        from kubellm.backends.kubernetes.pytorchjob import PyTorchJobTrainer

        return PyTorchJobTrainer(cluster=self.cluster_settings)

    @cached_property
    def tuner(self) -> Tuner:
        if self.cfg.platform == "slurm":  # the trials as one array job
            from kubellm.backends.slurm.tuner import SlurmTuner

            return SlurmTuner(self.slurm_settings)
        if self.local:
            from kubellm.backends.local.optuna_tuner import OptunaTuner

            return OptunaTuner(self.trainer)
        from kubellm.backends.kubernetes.katib import KatibTuner

        return KatibTuner(cluster=self.cluster_settings)

    @cached_property
    def server(self) -> Server:
        if self.local:
            from kubellm.backends.local.model_server import LocalModelServer

            return LocalModelServer(Path(self.cfg.runs_dir) / "servers")
        from kubellm.backends.kubernetes.inferenceservice import InferenceServiceServer

        return InferenceServiceServer(namespace=self.cfg.namespace)

    def release_run(self, champion: str | None) -> list[str]:
        """The exit handler's cleanup on a cluster: delete the run's Katib Experiments (their
        trials' jobs go with them), then its PyTorchJobs and TrainJobs, then take what it
        deployed and did not promote out of service (`Server.release_unpromoted`; `champion`
        as there). Returns what was done, a line each.

        Both training kinds, whatever `trainer_backend` says: the exit handler is not given
        every parameter (components/summarize.py), and a kind the cluster does not serve
        has nothing to delete (a 404 on the list).

        It runs on a stopped run too, where the steps' own cleanup may have been cut short
        (kubellm.backends.kubernetes.release). On Slurm it cancels the run's jobs still in
        squeue. Locally nothing but the servers outlives a step, and `server.release` stops
        those.
        """
        if self.cfg.platform == "slurm":  # the run's jobs still in squeue
            return self.trainer.release(self.kfp_run_id, "")
        if self.local:
            return []
        ns, run = self.cfg.namespace, self.kfp_run_id
        from kubellm.backends.kubernetes.pytorchjob import PyTorchJobTrainer
        from kubellm.backends.kubernetes.trainjob import TrainJobTrainer

        done = self.tuner.release(run, ns)
        for trainer in (PyTorchJobTrainer, TrainJobTrainer):
            done += trainer(cluster=self.cluster_settings).release(run, ns)
        return done + self.server.release_unpromoted(run, champion)

    @cached_property
    def tracking(self) -> Tracking:
        uri = self.cfg.mlflow_tracking_uri
        if self.local and not uri.startswith(("http://", "https://")):
            # sqlite: artifacts beside it; a tracking server keeps (proxies) its own
            location = (Path(self.cfg.runs_dir) / "mlartifacts").resolve().as_uri()
            return Tracking(location, f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1")
        return Tracking(None, f"open {redact(uri)}")


def resolve(cfg: PipelineConfig) -> PipelineConfig:
    """Fill the values that depend on where we run: absolute local paths, the tracking
    URI (sqlite under runs_dir locally; $MLFLOW_TRACKING_URI, from the kubellm-config
    ConfigMap, on a cluster) and, locally, an auto nproc_per_node: one process per GPU of
    this machine (a cluster's pods get gpus_per_node or CPU_NPROC, sized where the config
    is validated)."""
    runs = Path(cfg.runs_dir).expanduser()
    uri = cfg.mlflow_tracking_uri
    if cfg.platform != "kubernetes":  # local, or slurm from this login node
        if cfg.platform == "local" and cfg.nproc_follows_gpus:
            from kubellm.backends.local.torchrun import visible_gpus

            cfg = cfg.with_local_gpus(visible_gpus())
        runs = runs.resolve()
        uri = uri or f"sqlite:///{runs / 'mlflow.db'}"
    else:
        uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "http://mlflow.kubellm:5000")
    return cfg.model_copy(update={"runs_dir": str(runs), "mlflow_tracking_uri": uri})


def select(cfg: PipelineConfig, kfp_run_id: str) -> Backends:
    """The backends for `cfg.platform` (constructed lazily, each at most once)."""
    return Backends(cfg, kfp_run_id)
