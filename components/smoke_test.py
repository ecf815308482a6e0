"""smoke_test: real prompts to the served model; promote to champion or roll back."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Markdown, Metrics, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def smoke_test(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    endpoint: str,
    predictions: Input[Dataset],
    version: str,
    metrics: Output[Metrics],
    report: Output[Markdown],
) -> str:
    """Returns the served answer to the first prompt."""
    from kubellm.stages import smoke_test
    from kubellm.stages.context import StageContext

    ctx = StageContext.load(config, parent_run_id, kfp_run_id)
    result = smoke_test.run(ctx, endpoint, predictions.path, version)
    result.write_outputs(metrics=metrics, report=report)
    return result.answer
