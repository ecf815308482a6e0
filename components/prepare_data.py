"""prepare_data: text to packed, sharded Parquet with a manifest."""

from kfp import dsl
from kfp.dsl import Dataset, Markdown, Metrics, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def prepare_data(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    dataset: Output[Dataset],
    stats: Output[Metrics],
    report: Output[Markdown],
) -> str:
    from kubellm.stages import prepare_data
    from kubellm.stages.context import StageContext

    ctx = StageContext.load(config, parent_run_id, kfp_run_id)
    result = prepare_data.run(ctx, dataset.path)
    dataset.metadata["source_fingerprint"] = result.fingerprint
    dataset.metadata["data_fingerprint"] = result.data_fingerprint
    result.write_outputs(metrics=stats, report=report)
    return result.data_state  # "changed" trains; "unchanged": the run stops here
