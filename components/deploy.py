"""deploy: a local KServe ModelServer or an InferenceService; waits until ready."""

from kfp import dsl
from kfp.dsl import Input, Model

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def deploy(
    config: str, parent_run_id: str, kfp_run_id: str, model: Input[Model], version: str
) -> str:
    from kubellm.serve.stage import run_deploy
    from kubellm.stage import StageContext

    ctx = StageContext.load(config, parent_run_id, kfp_run_id)
    return run_deploy(ctx, model.path, version)
