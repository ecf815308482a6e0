"""stages.summarize: the exit handler's summary from MLflow, and the parent run closed."""

from __future__ import annotations

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
