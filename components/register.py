"""register: an MLflow model version with lineage tags, alias `challenger`."""

from kfp import dsl
from kfp.dsl import Input, Markdown, Model, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def register(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    model: Input[Model],
    report: Output[Markdown],
) -> str:
    """Returns the registered model version."""
    from kubellm.stages import register
    from kubellm.stages.context import StageContext

    result = register.run(StageContext.load(config, parent_run_id, kfp_run_id), model.path)
    result.write_outputs(report=report)
    return result.version
