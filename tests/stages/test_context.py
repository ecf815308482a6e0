"""stages.context: a result reaches KFP's output artifacts; config mappings."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kubellm.config import ConfigError, pipeline_config
from kubellm.stages.configs import model_shape, train_config
from kubellm.stages.context import StageResult, markdown_table


class Sink:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log_metric(self, metric: str, value: float) -> None:
        self.logged[metric] = value


def test_write_outputs_logs_every_metric_and_writes_the_report(tmp_path: Path) -> None:
    result = StageResult(metrics={"a": 1, "b": 0.5}, report="# R\n", headline="h")
    sink, report = Sink(), SimpleNamespace(path=str(tmp_path / "out" / "report"))
    result.write_outputs(metrics=sink, report=report)
    assert sink.logged == {"a": 1.0, "b": 0.5}
    assert (tmp_path / "out" / "report").read_text() == "# R\n"


def test_markdown_table_formats_figures() -> None:
    text = markdown_table("T", [("n", 3.0), ("x", 0.123456)], "intro")
    assert text.splitlines() == [
        "# T",
        "",
        "intro",
        "",
        "| | |",
        "|---|---|",
        "| n | 3 |",
        "| x | 0.1235 |",
    ]


def test_train_config_maps_the_pipeline_and_validates_job_values(tmp_path: Path) -> None:
    cfg = pipeline_config({"seq_len": 512, "hidden_size": 64, "num_heads": 8})
    shape = model_shape(cfg)
    assert (shape.hidden_size, shape.intermediate_size, shape.max_position_embeddings) == (
        64,
        128,
        512,
    )
    job = train_config(cfg, tmp_path, tmp_path, steps=7)
    assert (job.steps, job.model, job.batch_size) == (7, shape, cfg.batch_size)
    with pytest.raises(ConfigError, match=r"invalid steps=0"):
        train_config(cfg, tmp_path, tmp_path, steps=0)
