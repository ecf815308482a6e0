"""register: an MLflow model version with lineage tags, alias `challenger`."""

from kfp import dsl
from kfp.dsl import Input, Model

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def register(config: str, parent_run_id: str, kfp_run_id: str, model: Input[Model]) -> str:
    from kubellm.register.stage import run_register
    from kubellm.stage import StageContext

    return run_register(StageContext.load(config, parent_run_id, kfp_run_id), model.path)
