"""What every pipeline stage starts from: the validated config, the tracker, the workspace.

Components pass three strings (the config preflight validated, the parent MLflow run, the
KFP run id); `StageContext.load` turns them back into objects, so component bodies stay a
few lines and all logic stays testable here without KFP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubellm import platform
from kubellm.config import LoraSettings, PipelineConfig, TrainConfig
from kubellm.jobs import TrainJob, dns_name
from kubellm.tracking import Tracker


@dataclass(frozen=True)
class StageContext:
    cfg: PipelineConfig
    tracker: Tracker
    parent_run_id: str
    kfp_run_id: str

    @classmethod
    def load(cls, config_json: str, parent_run_id: str, kfp_run_id: str) -> StageContext:
        cfg = PipelineConfig.model_validate_json(config_json)
        return cls(cfg, Tracker.open(cfg, kfp_run_id), parent_run_id, kfp_run_id)

    @property
    def workspace(self) -> platform.Workspace:
        return platform.workspace(self.cfg, self.kfp_run_id)

    def stage_runs(self) -> dict[str, Any]:
        """The latest child run of each stage so far, by stage name (for lineage)."""
        out: dict[str, Any] = {}
        for run in self.tracker.children(self.parent_run_id):
            out[run.data.tags.get("kubellm.stage", run.info.run_name)] = run
        return out

    def train_job(self, name: str, train_cfg: TrainConfig) -> TrainJob:
        """A TrainJob for this pipeline's topology, its config written where jobs read it."""
        path = self.workspace.dir("config") / f"{name}.json"
        path.write_text(train_cfg.model_dump_json(indent=2))
        cfg = self.cfg
        return TrainJob(
            name=dns_name(cfg.model_name, name, self.kfp_run_id[:12]),
            train_args=["--config", str(path)],
            nnodes=cfg.num_nodes,
            nproc_per_node=cfg.nproc_per_node,
            timeout_s=cfg.job_timeout_minutes * 60.0,
            image=cfg.trainer_image,
            namespace=cfg.namespace,
            env={"MLFLOW_TRACKING_URI": cfg.mlflow_tracking_uri},
            workspace_pvc=self.workspace.pvc_name,
        )

    def base_train_config(self, dataset_dir: Path, output_dir: Path, **values: Any) -> TrainConfig:
        cfg = self.cfg
        return TrainConfig(
            dataset_dir=str(dataset_dir),
            output_dir=str(output_dir),
            batch_size=cfg.batch_size,
            learning_rate=cfg.learning_rate,
            seed=cfg.seed,
            model=cfg.model_shape(),
            model_name_or_path=cfg.base_model,
            trust_remote_code=cfg.trust_remote_code,
            strategy=cfg.strategy,
            precision=cfg.precision,
            lora=LoraSettings.model_validate({"r": cfg.lora_r}) if cfg.lora_r else None,
            mlflow_tracking_uri=cfg.mlflow_tracking_uri,
            **values,
        )


def write_json(path: str | Path, value: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(value, indent=2, sort_keys=True))
