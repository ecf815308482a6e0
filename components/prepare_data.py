"""prepare_data: text to packed, sharded Parquet with a manifest.

Its one parameter is preflight's data_spec (data parameters and source file versions), so
its KFP cache key is the data: a run on the same data reuses the dataset on a cluster.
Lineage and the comparison with the champion happen in record_data, which never caches.
"""

from kfp import dsl
from kfp.dsl import Dataset, Markdown, Metrics, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def prepare_data(
    data_spec: str,
    dataset: Output[Dataset],
    stats: Output[Metrics],
    report: Output[Markdown],
):
    from kubellm.stages import prepare_data

    result = prepare_data.run(data_spec, dataset.path)
    dataset.metadata["source_fingerprint"] = result.fingerprint
    dataset.metadata["data_fingerprint"] = result.data_fingerprint
    result.write_outputs(metrics=stats, report=report)
