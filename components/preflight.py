"""preflight: validate every parameter, open the MLflow lineage, check the fabric."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Markdown, Output

from kubellm import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def preflight(
    platform: str,
    slurm_partition: str,
    slurm_account: str,
    seed: int,
    data_source: str,
    allow_http_sources: bool,
    data_format: str,
    text_field: str,
    template: str,
    chat_loss: str,
    tokenizer: str,
    trust_remote_code: bool,
    packing: str,
    near_dedup: bool,
    on_error: str,
    mask_prompt: bool,
    num_records: int,
    val_fraction: float,
    vocab_size: int,
    seq_len: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    tune_trials: int,
    tune_steps: int,
    train_steps: int,
    batch_size: int,
    learning_rate: float,
    strategy: str,
    precision: str,
    base_model: str,
    lora_r: int,
    nproc_per_node: int,
    num_nodes: int,
    gate_min_accuracy: float,
    force: bool,
    pipeline_version: str,
    eval_data: str,
    gate_metric: str,
    gate_margin: float,
    gate_max_perplexity: float,
    gate_guards: dict,
    gate_allow_incomparable: bool,
    model_name: str,
    experiment_name: str,
    mlflow_tracking_uri: str,
    runs_dir: str,
    namespace: str,
    trainer_image: str,
    serving_image: str,
    serving_runtime: str,
    canary_traffic_percent: int,
    serving_cpu: str,
    serving_memory: str,
    serving_gpus: int,
    serving_min_replicas: int,
    serving_max_replicas: int,
    serving_dtype: str,
    serving_max_model_len: int,
    serving_node_selector: dict,
    serving_tolerations: list,
    serving_service_account: str,
    serving_cluster_local: bool,
    smoke_timeout_seconds: int,
    workspace_pvc: str,
    job_timeout_minutes: int,
    runtime_image: str,
    gpus_per_node: int,
    job_cpu: str,
    job_memory: str,
    job_max_restarts: int,
    elastic_min_nodes: int,
    elastic_max_restarts: int,
    step_cpu: str,
    step_memory: str,
    shm_size: str,
    evaluate_cpu: str,
    evaluate_memory: str,
    evaluate_gpus: int,
    register_cpu: str,
    register_memory: str,
    node_selector: dict,
    tolerations: list,
    priority_class: str,
    queue: str,
    gang_scheduler: str,
    trainer_backend: str,
    job_ttl_hours: int,
    job_grace_seconds: int,
    fabric: str,
    rdma_resource: str,
    rdma_count: int,
    network_annotation: str,
    nccl_env: dict,
    min_busbw_gbps: float,
    tune_algorithm: str,
    tune_parallel: int,
    tune_max_failed: int,
    tune_early_stopping: bool,
    kfp_run_id: str,
    report: Output[Markdown],
) -> NamedTuple(  # type: ignore[valid-type]
    "Outputs", [("config", str), ("parent_run_id", str), ("data_spec", str)]
):
    params = dict(locals())  # first statement: exactly the parameters
    for name in ("kfp_run_id", "report"):
        params.pop(name)
    from collections import namedtuple

    from kubellm.stages import preflight

    result = preflight.run(params, kfp_run_id)
    result.write_outputs(report=report)
    outputs = namedtuple("Outputs", ["config", "parent_run_id", "data_spec"])
    return outputs(result.config, result.parent_run_id, result.data_spec)
