"""record_data: the dataset in the run's MLflow lineage; "changed" or "unchanged" since the
champion (the DAG's condition for training)."""

from kfp import dsl
from kfp.dsl import Dataset, Input

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def record_data(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    dataset: Input[Dataset],
) -> str:
    from kubellm.stages import record_data
    from kubellm.stages.context import StageContext

    ctx = StageContext.load(config, parent_run_id, kfp_run_id)
    return record_data.run(ctx, dataset.path).data_state  # "unchanged": the run stops
