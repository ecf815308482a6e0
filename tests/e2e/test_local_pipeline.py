"""End to end: `kubellm run --local` runs the compiled YAML through kfp.local, for real.

Small model and data so the suite stays quick; the full-size run is `make run`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from .conftest import REJECT_ABOVE, STAGES, Batch, LocalRun

# waiting on the batch (tests/e2e/conftest.py) is most of a test: the runs share the cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
FINGERPRINT = "kubellm.data_fingerprint"


def _client(tmp: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")


def _children(client: MlflowClient, parent: Any) -> dict[str, Any]:
    runs = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    return {r.data.tags["kubellm.stage"]: r for r in runs}


@pytest.mark.pipeline_runs("local")
def test_full_pipeline_serves_and_records_lineage(local_run: LocalRun) -> None:
    """The whole DAG against a real `mlflow server` on loopback (HTTP client, proxied
    artifacts, the trainer's background sink), as on a cluster; then `kubellm lineage`
    reads the chain back from that server. The run is the session's `local_run`, which the
    cluster test compares its figures with."""
    tmp_path, proc, server = local_run.tmp, local_run.proc, local_run.server
    assert server is not None
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    children = _check_run(tmp_path, proc.stdout, MlflowClient(server.url))
    text, as_json = (
        subprocess.run(
            [sys.executable, "-m", "kubellm.cli", "lineage", "kubellm-tiny@champion", *flag],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "MLFLOW_TRACKING_URI": server.url},
            check=True,
        ).stdout
        for flag in ([], ["--json"])
    )
    # any MLflow client loads the champion from the server's registry and generates
    smoke = children["smoke_test"].data.params
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys, mlflow; m = mlflow.pyfunc.load_model("
            "'models:/kubellm-tiny@champion'); print(json.dumps(m.predict([sys.argv[1]])))",
            smoke["prompt"],
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MLFLOW_TRACKING_URI": server.url},
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    # the same weights and greedy decoding as the served model's answer in the smoke test
    assert json.loads(loaded.stdout.strip().splitlines()[-1]) == [smoke["answer"]]
    chain = json.loads(as_json)
    assert chain["model"]["version"] == "1" and "champion" in chain["model"]["aliases"]
    assert chain["data"]["fingerprint"] == children["prepare_data"].data.tags[FINGERPRINT]
    assert chain["data"]["records_read"] == 3000
    assert chain["tuning"]["best_trial"].startswith("kubellm-tiny-tune-")
    assert chain["training"]["run"] == children["train"].info.run_id
    assert chain["evaluation"]["run"] == children["evaluate"].info.run_id
    assert chain["evaluation"]["gate"] == "promote"
    assert chain["deployment"]["endpoint"].startswith("http://127.0.0.1:")
    # the version comes from the run's logged model, whose artifacts are on the server
    # (proxied), not on this machine
    head = "kubellm-tiny v1 (challenger, champion): models:/"
    assert text.startswith(head), text
    model_id = text[len(head) :].split()[0]
    logged = MlflowClient(server.url).get_logged_model(model_id)
    assert logged.artifact_location.startswith("mlflow-artifacts:/"), logged.artifact_location
    for part in ("data", "tuning", "training", "evaluation", "gate", "deployment"):
        assert f"\n  {part} " in text, (part, text)


def _check_run(tmp_path: Path, out: str, client: MlflowClient) -> dict[str, Any]:
    """The summary, the terminal output and the MLflow record of a promoted run."""
    summary = out[out.rindex("=" * 78) :]
    assert ": SUCCEEDED" in summary and "pipeline succeeded" in summary
    for row in (
        "records read / kept | 3000 /",
        "best trial",
        "final train loss",
        "held-out exact match",
        "gate | promote (exact_match ",
        "model name / version | kubellm-tiny / 1",
        "prompt -> answer",
        f"Open the MLflow UI: `open {client.tracking_uri}`",
    ):
        assert row in summary, row
    gate = re.search(
        r"gate \| promote \(exact_match (\d\.\d+) >= gate_min_accuracy 0\.200\)", summary
    )
    assert gate, summary
    assert 0.2 <= float(gate.group(1)) < REJECT_ABOVE

    # what a person sees: a line per stage start and end, progress, the summary; the
    # executor's JSON and the jobs' full logs are in the log file whose path is printed
    before = out[: out.rindex("=" * 78)].splitlines()
    assert len(before) < 60, "\n".join(before)
    for stage in STAGES | {"record_data"}:  # record_data: the prepare_data MLflow run
        assert f"kubellm: {stage} started" in out, stage
        assert re.search(rf"kubellm: {stage} done in [\d.]+s: \S", out), stage
    assert re.search(r"train: \d+/120 steps", out) and re.search(r"\] trial 1: ", out)
    assert "KFP Executor" not in out and "Traceback" not in out
    log = Path(re.findall(r"full log: (\S+)", out)[-1])
    assert log.parent == tmp_path / "runs" / "logs"
    assert "KFP Executor" in log.read_text()

    # the committed YAML (renamed copy) is what kfp.local ran
    assert list((tmp_path / "runs" / "kfp").glob("e2e-copy-*"))

    [exp] = [e for e in client.search_experiments() if e.name == "kubellm"]
    parents = client.search_runs([exp.experiment_id], "tags.`kubellm.stage` = 'pipeline'")
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    children = _children(client, parent)
    assert set(children) == STAGES
    assert all(r.info.status == "FINISHED" for r in children.values())
    kfp_run = parent.data.tags["kubellm.kfp_run_id"]

    mv = client.get_model_version_by_alias("kubellm-tiny", "champion")
    assert mv.tags["kubellm.kfp_run_id"] == kfp_run
    assert mv.tags["kubellm.pipeline_run"] == parent.info.run_id
    fingerprint = children["prepare_data"].data.tags[FINGERPRINT]
    assert mv.tags["kubellm.data_fingerprint"] == fingerprint and len(fingerprint) == 64
    assert mv.tags["kubellm.training_run"] == children["train"].info.run_id
    assert mv.tags["kubellm.best_trial"].startswith("kubellm-tiny-tune-")
    assert children["smoke_test"].data.metrics["agreement"] >= 0.9

    # the local server lived only for the run
    servers = tmp_path / "runs" / "servers"
    assert not list(servers.glob("*.json")), "a model server was left running"
    state_logs = list(servers.glob("*.log"))
    assert state_logs and "serving kubellm-tiny" in state_logs[0].read_text()
    return children


@pytest.mark.pipeline_runs("reject")
def test_gate_rejects_and_nothing_is_registered(batch: Batch) -> None:
    run = batch.result("reject")  # gate_min_accuracy=REJECT_ABOVE, no tuning
    tmp_path, proc = run.tmp, run.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gate = re.search(
        r"gate \| reject \(exact_match (\d\.\d+) < gate_min_accuracy 0\.900\)", proc.stdout
    )
    assert gate, proc.stdout[-3000:]
    # a model the default gate would have promoted: the rejection is the threshold's doing
    assert 0.2 <= float(gate.group(1)) < REJECT_ABOVE
    client = _client(tmp_path)
    assert client.search_registered_models() == []
    [parent] = client.search_runs(
        [client.get_experiment_by_name("kubellm").experiment_id],
        "tags.`kubellm.stage` = 'pipeline'",
    )
    assert set(_children(client, parent)) == {
        "preflight",
        "prepare_data",
        "tune",
        "train",
        "evaluate",
    }


@pytest.mark.pipeline_runs("failing")
def test_a_failing_stage_fails_the_run_with_its_reason(batch: Batch) -> None:
    run = batch.result("failing")  # data_source: a pattern that matches no file
    tmp_path, proc = run.tmp, run.proc
    assert proc.returncode == 1
    assert ": FAILED" in proc.stdout and "pipeline FAILED" in proc.stdout
    # preflight lists the data source (data_spec), so a wrong path fails there, in seconds
    assert "preflight: data source" in proc.stdout and "matches no file" in proc.stdout
    client = _client(tmp_path)
    [parent] = client.search_runs(
        [client.get_experiment_by_name("kubellm").experiment_id],
        "tags.`kubellm.stage` = 'pipeline'",
    )
    assert parent.info.status == "FAILED"
    assert parent.data.tags["kubellm.state"] == "FAILED"
    [failed] = [r for r in _children(client, parent).values() if r.info.status == "FAILED"]
    assert failed.data.tags["kubellm.stage"] == "preflight"
    assert "matches no file" in failed.data.tags["kubellm.error"]
