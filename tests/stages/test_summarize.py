"""stages.summarize: the exit handler's summary from MLflow, and the parent run closed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kubellm import backends
from kubellm.stages import summarize
from kubellm.stages.context import StageContext
from stages.conftest import RUN, Chain

# How "Failed stages:" starts when no stage run recorded the failure.
NO_STAGE = "no stage recorded an error: a step failed before or outside its stage"


def test_summary_reads_every_stage_from_mlflow(chain: Chain, ctx: StageContext) -> None:
    result = summarize.run(chain.params, RUN, "SUCCEEDED")
    prepared = chain.results["prepare_data"].metrics
    assert result.report.startswith(f"# kubellm run {RUN}: SUCCEEDED")
    read, kept = int(prepared["records_read"]), int(prepared["records_kept"])
    assert f"| records read / kept | {read} / {kept} |" in result.report
    assert f"| model name / version | tiny-stage / {chain.results['register'].version} |" in (
        result.report
    )
    assert "mlflow ui --backend-store-uri sqlite:///" in result.report
    parent = ctx.tracker.client.get_run(ctx.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["kubellm.state"] == "SUCCEEDED"


def test_without_a_parent_run_it_says_so(chain: Chain) -> None:
    result = summarize.run(chain.params, "never-started", "FAILED", "preflight failed")
    assert result.report.startswith("# kubellm run never-started: FAILED")
    assert "No MLflow parent run was found" in result.report


def test_stage_runs_left_running_by_a_killed_step_end_killed(tmp_path: Path) -> None:
    from kubellm.config import pipeline_config
    from kubellm.stages.context import open_tracker
    from kubellm.tracking import TAG_KFP_RUN, TAG_PARENT, TAG_STAGE
    from stages.conftest import TINY

    params = {**TINY, "runs_dir": str(tmp_path / "runs")}
    cfg = backends.resolve(pipeline_config(params))
    tracker = open_tracker(cfg, "killed")
    parent = tracker.start_parent("killed", {})
    tags = {TAG_PARENT: parent, TAG_KFP_RUN: "killed", TAG_STAGE: "train"}
    child = tracker.client.create_run(tracker.experiment_id, run_name="train", tags=tags)
    summarize.run(params, "killed", "FAILED", "train: pod deleted")
    run = tracker.client.get_run(child.info.run_id)
    assert run.info.status == "KILLED"
    assert "still RUNNING when the pipeline ended FAILED" in run.data.tags["kubellm.error"]
    assert tracker.client.get_run(parent).info.status == "FAILED"


def test_a_run_that_stopped_early_shows_only_the_stages_that_ran(
    chain: Chain, ctx: StageContext
) -> None:
    """Unchanged data: the run ends after prepare_data; the summary says why and has no
    rows of "-" for the stages that never ran."""
    from kubellm.stages.record_data import TAG_UNCHANGED
    from kubellm.tracking import TAG_FINGERPRINT
    from stages.conftest import side_context

    skipped = side_context(ctx, "skipped")
    verdict = "data unchanged since champion v1: training skipped (force=true retrains)"
    for stage in ("preflight", "prepare_data"):
        with skipped.tracker.stage(skipped.parent_run_id, stage) as run_id:
            if stage == "preflight":
                skipped.tracker.log(run_id, metrics={"allreduce_busbw_gbps": 1.5})
            else:
                skipped.tracker.log(
                    run_id,
                    metrics={"records_read": 600.0, "records_kept": 500.0},
                    tags={TAG_UNCHANGED: verdict, TAG_FINGERPRINT: "ab" * 32},
                )
    report = summarize.run(chain.params, "skipped", "SUCCEEDED").report
    assert "Data unchanged since champion v1: training skipped" in report
    assert "| records read / kept | 600 / 500 |" in report
    assert f"| data | {verdict} |" in report
    for absent in ("best trial", "final train loss", "gate", "endpoint", "prompt -> answer"):
        assert f"| {absent} |" not in report, absent
    assert "| - |" not in report


# ----------------------------------------------------------------- the backend's own words


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Pipeline parameters with one runs_dir (one MLflow store) for this module's runs."""
    from stages.conftest import TINY

    return {**TINY, "runs_dir": str(tmp_path_factory.mktemp("summarize") / "runs")}


def _tracked_run(params: dict[str, Any], run: str) -> tuple[Any, str]:
    """A tracker and a parent run for pipeline run `run`, without the stage chain."""
    from kubellm.config import pipeline_config
    from kubellm.stages.context import open_tracker

    tracker = open_tracker(backends.resolve(pipeline_config(params)), run)
    return tracker, tracker.start_parent(run, {})


def test_the_backends_complete_is_success_on_the_summary_and_the_mlflow_parent(
    runs: dict[str, Any],
) -> None:
    """The KFP backend hands the exit handler the MLMD state COMPLETE, not kfp.local's
    SUCCEEDED (backend/src/v2/driver/resolve.go at 2.17.0)."""
    tracker, parent = _tracked_run(runs, "complete")
    with tracker.stage(parent, "train"):
        pass
    result = summarize.run(runs, "complete", "COMPLETE")
    assert result.report.splitlines()[0] == "# kubellm run complete: SUCCEEDED"
    assert "Failed stages:" not in result.report
    run = tracker.client.get_run(parent)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags["kubellm.state"], tags["kubellm.backend_state"]) == ("SUCCEEDED", "COMPLETE")
    assert tags["kubellm.error"] == ""


def test_without_the_backends_error_the_error_comes_from_the_failed_stage(
    runs: dict[str, Any],
) -> None:
    """The backend never fills PipelineTaskFinalStatus.error: the failed stage run's
    kubellm.error is the run's error."""
    tracker, parent = _tracked_run(runs, "failed")
    with tracker.stage(parent, "preflight"):
        pass
    with pytest.raises(RuntimeError), tracker.stage(parent, "train"):
        raise RuntimeError("PyTorchJob kubellm-train-x failed: exit code 1")
    result = summarize.run(runs, "failed", "FAILED", "")
    assert result.report.splitlines()[0] == "# kubellm run failed: FAILED"
    assert "\nFailed stages:\n- train: PyTorchJob kubellm-train-x failed: exit code 1\n" in (
        result.report
    )
    run = tracker.client.get_run(parent)
    assert run.info.status == "FAILED"
    assert run.data.tags["kubellm.error"] == "train: PyTorchJob kubellm-train-x failed: exit code 1"
    assert run.data.tags["kubellm.backend_state"] == "FAILED"


@dataclass(frozen=True)
class FailedCase:
    name: str
    state: str
    child: str  # "killed": a stage run left RUNNING; "finished": every stage run finished
    listed: str  # what "Failed stages:" must list
    finished: tuple[str, ...] = ("preflight",)  # the stage runs that finished ("finished")


# The data steps keep one MLflow run between them, made by record_data: a bad record that
# fails prepare_data (on_error=fail) leaves none, and the summary says where it stopped.
AT_DATA = "- stopped at prepare_data or record_data, which recorded no MLflow run: "
FAILED_CASES = [
    FailedCase("a stage killed with its step", "FAILED", "killed", "- train (KILLED): still"),
    FailedCase("no stage failed (the driver did)", "FAILED", "finished", AT_DATA + NO_STAGE),
    FailedCase("a stopped run's DAG left RUNNING", "RUNNING", "finished", AT_DATA + NO_STAGE),
    FailedCase(
        "train's pod refused before its stage began",
        "FAILED",
        "finished",
        f"- stopped at train, which recorded no MLflow run: {NO_STAGE}",
        ("preflight", "prepare_data", "tune"),
    ),
]


@pytest.mark.parametrize("case", FAILED_CASES, ids=lambda c: c.name)
def test_failed_stages_is_never_empty_when_the_run_failed(
    runs: dict[str, Any], case: FailedCase
) -> None:
    from kubellm.tracking import TAG_KFP_RUN, TAG_PARENT, TAG_STAGE

    run = f"failed-{FAILED_CASES.index(case)}"
    tracker, parent = _tracked_run(runs, run)
    if case.child == "killed":
        tags = {TAG_PARENT: parent, TAG_KFP_RUN: run, TAG_STAGE: "train"}
        tracker.client.create_run(tracker.experiment_id, run_name="train", tags=tags)
    else:
        for stage in case.finished:
            with tracker.stage(parent, stage):
                pass
    report = summarize.run(runs, run, case.state).report
    assert report.splitlines()[0] == f"# kubellm run {run}: FAILED"
    listed = report.split("\nFailed stages:\n", 1)[1]
    assert listed.startswith(case.listed), report
    assert tracker.client.get_run(parent).data.tags["kubellm.error"] != ""


def test_without_a_parent_a_failed_run_still_says_why(runs: dict[str, Any]) -> None:
    report = summarize.run(runs, "refused", "FAILED").report
    assert "No MLflow parent run was found" in report
    assert f"Failed stages:\n- {NO_STAGE}" in report
