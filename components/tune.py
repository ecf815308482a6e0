"""tune: optuna (local) or a Katib Experiment (cluster); trials are short training runs."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Markdown, Metrics, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def tune(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    dataset: Input[Dataset],
    metrics: Output[Metrics],
    report: Output[Markdown],
) -> str:
    """Returns the best hyperparameters as JSON (the train stage applies them)."""
    from kubellm.stages import tune
    from kubellm.stages.context import StageContext

    result = tune.run(StageContext.load(config, parent_run_id, kfp_run_id), dataset.path)
    result.write_outputs(metrics=metrics, report=report)
    return result.hparams_json
