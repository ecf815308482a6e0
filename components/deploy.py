"""deploy: a local KServe ModelServer or an InferenceService; waits until ready."""

from kfp import dsl
from kfp.dsl import Input, Markdown, Model, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def deploy(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    model: Input[Model],
    version: str,
    report: Output[Markdown],
) -> str:
    """Returns the endpoint's base URL."""
    from kubellm.stages import deploy
    from kubellm.stages.context import StageContext

    result = deploy.run(StageContext.load(config, parent_run_id, kfp_run_id), model.path, version)
    result.write_outputs(report=report)
    return result.endpoint
