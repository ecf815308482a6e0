"""Helpers of the training tests: a tiny config, config files, the printed losses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubellm.config import TrainConfig
from kubellm.train.metric_lines import parse_metrics

TINY_MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def tiny_config(dataset: Path, output_dir: Path, **values: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "dataset_dir": str(dataset),
        "output_dir": str(output_dir),
        "steps": 8,
        "batch_size": 8,
        "log_every": 1,
        "eval_batches": 2,
        "model": TINY_MODEL,
    }
    return TrainConfig.model_validate({**base, **values})


def write_config(path: Path, cfg: TrainConfig) -> Path:
    path.write_text(json.dumps(cfg.model_dump()))
    return path


def step_losses(logs: str) -> dict[int, str]:
    """step -> the loss exactly as printed (6 significant digits, all-reduced over ranks)."""
    out = {}
    for line in logs.splitlines():
        m = parse_metrics(line)
        if "step" in m and "loss" in m:
            out[int(m["step"])] = line.split("loss=")[1].split()[0]
    return out
