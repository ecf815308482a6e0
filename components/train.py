"""train: torchrun (local) or a PyTorchJob (cluster) running `python -m kubellm.train`."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def train(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    dataset: Input[Dataset],
    hparams: str,
    model: Output[Model],
    metrics: Output[Metrics],
):
    from kubellm.stage import StageContext
    from kubellm.train.stage import run_train

    ctx = StageContext.load(config, parent_run_id, kfp_run_id)
    for name, value in run_train(ctx, dataset.path, hparams, model.path).items():
        metrics.log_metric(name, value)
    model.metadata["framework"] = "transformers"
    model.metadata["format"] = "safetensors"
