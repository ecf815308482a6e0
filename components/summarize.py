"""summarize (exit handler): stop run-scoped servers, close the MLflow run, write a report."""

from kfp import dsl
from kfp.dsl import Markdown, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def summarize(
    platform: str,
    mlflow_tracking_uri: str,
    runs_dir: str,
    experiment_name: str,
    model_name: str,
    kfp_run_id: str,
    status: dsl.PipelineTaskFinalStatus,
    report: Output[Markdown],
):
    from kubellm.summary import run_summary

    params = {
        "platform": platform,
        "mlflow_tracking_uri": mlflow_tracking_uri,
        "runs_dir": runs_dir,
        "experiment_name": experiment_name,
        "model_name": model_name,
    }
    text = run_summary(params, kfp_run_id, status.state, status.error_message or "")
    with open(report.path, "w") as fh:
        fh.write(text)
