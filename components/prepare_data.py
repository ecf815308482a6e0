"""prepare_data: text to packed, sharded Parquet with a manifest."""

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def prepare_data(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    dataset: Output[Dataset],
    stats: Output[Metrics],
):
    from kubellm.data.stage import run_prepare
    from kubellm.stage import StageContext

    manifest = run_prepare(StageContext.load(config, parent_run_id, kfp_run_id), dataset.path)
    dataset.metadata["source_fingerprint"] = manifest["source_fingerprint"]
    for key in ("read", "kept", "train", "val"):
        stats.log_metric(f"records_{key}", manifest["records"][key])
    for split in ("train", "val"):
        stats.log_metric(f"tokens_{split}", manifest["tokens"][split])
