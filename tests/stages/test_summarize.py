"""stages.summarize: the exit handler's summary from MLflow, and the parent run closed."""

from __future__ import annotations

from pathlib import Path

from kubellm import backends
from kubellm.stages import summarize
from kubellm.stages.context import StageContext
from stages.conftest import RUN, Chain


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
