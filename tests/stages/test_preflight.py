"""stages.preflight: validation before anything starts, the parent run, the fabric check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from kubellm.config import ConfigError, PipelineConfig
from kubellm.stages import preflight
from stages.conftest import RUN, TINY, Chain


def test_result_carries_the_resolved_config_and_the_parent_run(chain: Chain) -> None:
    result = chain.results["preflight"]
    cfg = PipelineConfig.model_validate_json(result.config)
    assert Path(cfg.runs_dir).is_absolute()
    assert cfg.mlflow_tracking_uri == f"sqlite:///{cfg.runs_dir}/mlflow.db"
    parent = MlflowClient(cfg.mlflow_tracking_uri).get_run(result.parent_run_id)
    assert parent.data.tags["kubellm.stage"] == "pipeline"
    assert parent.data.tags["kubellm.kfp_run_id"] == RUN
    # the fabric check ran under torchrun with the training topology (1 process here)
    assert result.metrics["allreduce_ms"] > 0
    assert result.metrics["allreduce_busbw_gbps"] == 0.0  # one rank moves no bytes
    assert result.parent_run_id in result.headline
    assert "| processes | 1 x 1 |" in result.report


def test_invalid_parameter_fails_naming_it_before_any_run(tmp_path: Path) -> None:
    params = {**TINY, "runs_dir": str(tmp_path / "runs"), "batch_size": 7, "nproc_per_node": 2}
    with pytest.raises(ConfigError, match=r"batch_size \(7\) must be divisible"):
        preflight.run(params, "bad-run")
    assert not (tmp_path / "runs").exists(), "a tracking store was created for an invalid config"


def test_a_bad_eval_data_file_fails_preflight_naming_file_and_line(tmp_path: Path) -> None:
    """The user's task is read in full before anything trains: a bad line found after an
    hour of training would waste the hour."""
    from kubellm.data.records import DataError

    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    params = {**TINY, "runs_dir": str(tmp_path / "runs"), "eval_data": str(task)}
    with pytest.raises(DataError, match=r"task\.jsonl:2: no 'completion' / 'answer'"):
        preflight.run(params, "bad-task")


@pytest.mark.parametrize(
    ("params", "args"),
    [
        ({}, []),
        ({"min_busbw_gbps": 40.5}, ["--min-busbw-gbps", "40.5"]),
        (
            {"platform": "kubernetes", "gpus_per_node": 2, "fabric": "roce"},
            ["--require-gpu", "--require-rdma"],
        ),
        # locally there is no RDMA to require; the profile is for the cluster's pods
        ({"platform": "local", "gpus_per_node": 2, "fabric": "rdma-ib"}, ["--require-gpu"]),
    ],
)
def test_fabric_check_flags_follow_the_parameters(params: dict[str, Any], args: list[str]) -> None:
    from kubellm.config import pipeline_config
    from kubellm.stages.preflight import fabric_args

    assert fabric_args(pipeline_config(params)) == args


def test_an_unreachable_tracking_server_fails_in_seconds_naming_it(tmp_path: Path) -> None:
    """MLflow's client alone retries a refused connection for ~4 minutes; preflight checks
    the server's /health with a short timeout first."""
    import socket
    import time

    from kubellm.tracking import TrackingUnavailable

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    params = {**TINY, "runs_dir": str(tmp_path / "runs"), "mlflow_tracking_uri": uri}
    began = time.monotonic()
    with pytest.raises(TrackingUnavailable, match=rf"MLflow tracking server {uri} is unreachable"):
        preflight.run(params, "no-server")
    assert time.monotonic() - began < 15


def test_a_retried_preflight_reuses_the_parent_run(tmp_path: Path) -> None:
    params = {**TINY, "runs_dir": str(tmp_path / "runs")}
    first = preflight.run(params, "retried")
    second = preflight.run(params, "retried")  # the KFP retry of the same run's step
    assert second.parent_run_id == first.parent_run_id
    cfg = PipelineConfig.model_validate_json(first.config)
    parents = MlflowClient(cfg.mlflow_tracking_uri).search_runs(
        [MlflowClient(cfg.mlflow_tracking_uri).get_run(first.parent_run_id).info.experiment_id],
        filter_string="tags.`kubellm.stage` = 'pipeline'",
    )
    assert len(parents) == 1
