"""train: torchrun (local) or a PyTorchJob (cluster) running `python -m kubellm.train`."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Markdown, Metrics, Model, Output

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
    report: Output[Markdown],
):
    from kubellm.stages import train
    from kubellm.stages.context import StageContext

    ctx = StageContext.load(config, parent_run_id, kfp_run_id)
    result = train.run(ctx, dataset.path, hparams, model.path)
    model.metadata.update(result.model_metadata)
    result.write_outputs(metrics=metrics, report=report)
