"""tune: optuna (local) or a Katib Experiment (cluster); trials are short training runs."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def tune(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    dataset: Input[Dataset],
    metrics: Output[Metrics],
) -> str:
    from kubellm.stage import StageContext
    from kubellm.tune.stage import params_json, run_tune

    result = run_tune(StageContext.load(config, parent_run_id, kfp_run_id), dataset.path)
    if result["objective"] is not None:
        metrics.log_metric("best_eval_loss", result["objective"])
    for name, value in result["params"].items():
        metrics.log_metric(f"best_{name}", value)
    return params_json(result)
