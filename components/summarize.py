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
    namespace: str,
    kfp_run_id: str,
    status: dsl.PipelineTaskFinalStatus,
    report: Output[Markdown],
):
    params = dict(locals())  # first statement: exactly the parameters
    for name in ("kfp_run_id", "status", "report"):
        params.pop(name)
    from kubellm.stages import summarize

    result = summarize.run(params, kfp_run_id, status.state, status.error_message or "")
    result.write_outputs(report=report)
