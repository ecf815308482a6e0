"""The kubellm DAG: preflight → prepare_data → record_data → tune → train → evaluate → [gate] →
register → deploy → smoke_test, inside an exit handler that stops run-scoped servers and
writes a summary.

Compile (the committed llm_train.yaml must match; a test checks it):

    kubellm compile

The parameters are exactly kubellm.config.PipelineConfig's fields, with its defaults and
descriptions; preflight validates them all before anything expensive starts.
"""

import sys
from pathlib import Path
from typing import Any

from kfp import dsl, kubernetes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.deploy import deploy
from components.evaluate import evaluate
from components.preflight import preflight
from components.prepare_data import prepare_data
from components.record_data import record_data
from components.register import register
from components.smoke_test import smoke_test
from components.summarize import summarize
from components.train import train
from components.tune import tune
from kubellm.backends.base import WORKSPACE_MOUNT

# The step's own pod (downward API), owner of the jobs it creates: deleting a run deletes them.
from kubellm.backends.kubernetes.client import (
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    POD_UID_ENV,
    RUN_AS_UID,
)
from kubellm.backends.kubernetes.podspec import GPU_RESOURCE, MLFLOW_SECRET, MLFLOW_SECRET_ENV
from kubellm.config import PipelineConfig
from kubellm.stages.evaluate import PROMOTE
from kubellm.stages.record_data import CHANGED as DATA_CHANGED

PIPELINE_NAME = "kubellm-llm-train"
SERVICE_ACCOUNT_NOTE = (
    "Run it as the kubellm-pipeline ServiceAccount (manifests/base): `kubellm submit "
    "--service-account kubellm-pipeline`, or the Service Account field of the run form."
)
CONFIG_MAP = "kubellm-config"

_D = {
    name: field.get_default(call_default_factory=True)
    for name, field in PipelineConfig.model_fields.items()
}


class _Cluster:
    """The pipeline parameters every step pod is wired with (image, resources, workspace)."""

    def __init__(self, runtime_image: Any, cpu: Any, memory: Any, workspace_pvc: Any) -> None:
        self.image, self.cpu, self.memory, self.pvc = runtime_image, cpu, memory, workspace_pvc

    def wire(
        self,
        task: dsl.PipelineTask,
        workspace: bool = True,
        *,
        cpu: Any = None,
        memory: Any = None,
        gpus: Any = None,
    ) -> dsl.PipelineTask:
        """Cluster-side settings of a step: its image and resources (parameters; `cpu`,
        `memory` and `gpus` for a step that loads the model), the tracking URI from the
        kubellm-config ConfigMap if there is one (else the mlflow_tracking_uri parameter),
        credentials from a Secret (never a parameter), its own pod's name and uid (owner of
        the jobs it creates), non-root, and the shared workspace volume."""
        task.set_container_image(self.image)
        cpu, memory = cpu if cpu is not None else self.cpu, memory or self.memory
        task.set_cpu_request(cpu).set_cpu_limit(cpu)
        task.set_memory_request(memory).set_memory_limit(memory)
        if gpus is not None:
            # The KFP driver sets limits[nvidia.com/gpu] to the count it resolves (0 too: a
            # zero limit fits any node, GPU or not).
            task.set_accelerator_type(GPU_RESOURCE).set_accelerator_limit(gpus)
        kubernetes.use_config_map_as_env(
            task,
            config_map_name=CONFIG_MAP,
            config_map_key_to_env={"MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI"},
            optional=True,
        )
        kubernetes.use_secret_as_env(
            task,
            secret_name=MLFLOW_SECRET,
            secret_key_to_env={key: env for env, key in MLFLOW_SECRET_ENV.items()},
            optional=True,
        )
        kubernetes.use_field_path_as_env(task, POD_NAME_ENV, "metadata.name")
        kubernetes.use_field_path_as_env(task, POD_UID_ENV, "metadata.uid")
        kubernetes.use_field_path_as_env(task, POD_NAMESPACE_ENV, "metadata.namespace")
        kubernetes.set_security_context(
            task, run_as_user=RUN_AS_UID, run_as_group=RUN_AS_UID, run_as_non_root=True
        )
        if workspace:
            kubernetes.mount_pvc(task, pvc_name=self.pvc, mount_path=WORKSPACE_MOUNT)
        return task


def llm_train(
    platform: str = _D["platform"],
    slurm_partition: str = _D["slurm_partition"],
    slurm_account: str = _D["slurm_account"],
    seed: int = _D["seed"],
    data_source: str = _D["data_source"],
    allow_http_sources: bool = _D["allow_http_sources"],
    data_format: str = _D["data_format"],
    text_field: str = _D["text_field"],
    template: str = _D["template"],
    chat_loss: str = _D["chat_loss"],
    tokenizer: str = _D["tokenizer"],
    trust_remote_code: bool = _D["trust_remote_code"],
    packing: str = _D["packing"],
    near_dedup: bool = _D["near_dedup"],
    on_error: str = _D["on_error"],
    mask_prompt: bool = _D["mask_prompt"],
    num_records: int = _D["num_records"],
    val_fraction: float = _D["val_fraction"],
    vocab_size: int = _D["vocab_size"],
    seq_len: int = _D["seq_len"],
    hidden_size: int = _D["hidden_size"],
    num_layers: int = _D["num_layers"],
    num_heads: int = _D["num_heads"],
    tune_trials: int = _D["tune_trials"],
    tune_steps: int = _D["tune_steps"],
    train_steps: int = _D["train_steps"],
    batch_size: int = _D["batch_size"],
    learning_rate: float = _D["learning_rate"],
    strategy: str = _D["strategy"],
    precision: str = _D["precision"],
    base_model: str = _D["base_model"],
    lora_r: int = _D["lora_r"],
    nproc_per_node: int = _D["nproc_per_node"],
    num_nodes: int = _D["num_nodes"],
    gate_min_accuracy: float = _D["gate_min_accuracy"],
    force: bool = _D["force"],
    pipeline_version: str = _D["pipeline_version"],
    eval_data: str = _D["eval_data"],
    gate_metric: str = _D["gate_metric"],
    gate_margin: float = _D["gate_margin"],
    gate_max_perplexity: float = _D["gate_max_perplexity"],
    gate_guards: dict = _D["gate_guards"],
    gate_allow_incomparable: bool = _D["gate_allow_incomparable"],
    model_name: str = _D["model_name"],
    experiment_name: str = _D["experiment_name"],
    mlflow_tracking_uri: str = _D["mlflow_tracking_uri"],
    runs_dir: str = _D["runs_dir"],
    namespace: str = _D["namespace"],
    trainer_image: str = _D["trainer_image"],
    serving_image: str = _D["serving_image"],
    serving_runtime: str = _D["serving_runtime"],
    canary_traffic_percent: int = _D["canary_traffic_percent"],
    serving_cpu: str = _D["serving_cpu"],
    serving_memory: str = _D["serving_memory"],
    serving_gpus: int = _D["serving_gpus"],
    serving_min_replicas: int = _D["serving_min_replicas"],
    serving_max_replicas: int = _D["serving_max_replicas"],
    serving_dtype: str = _D["serving_dtype"],
    serving_max_model_len: int = _D["serving_max_model_len"],
    serving_node_selector: dict = _D["serving_node_selector"],
    serving_tolerations: list = _D["serving_tolerations"],
    serving_service_account: str = _D["serving_service_account"],
    serving_cluster_local: bool = _D["serving_cluster_local"],
    smoke_timeout_seconds: int = _D["smoke_timeout_seconds"],
    workspace_pvc: str = _D["workspace_pvc"],
    job_timeout_minutes: int = _D["job_timeout_minutes"],
    runtime_image: str = _D["runtime_image"],
    gpus_per_node: int = _D["gpus_per_node"],
    job_cpu: str = _D["job_cpu"],
    job_memory: str = _D["job_memory"],
    job_max_restarts: int = _D["job_max_restarts"],
    elastic_min_nodes: int = _D["elastic_min_nodes"],
    elastic_max_restarts: int = _D["elastic_max_restarts"],
    step_cpu: str = _D["step_cpu"],
    step_memory: str = _D["step_memory"],
    shm_size: str = _D["shm_size"],
    evaluate_cpu: str = _D["evaluate_cpu"],
    evaluate_memory: str = _D["evaluate_memory"],
    evaluate_gpus: int = _D["evaluate_gpus"],
    register_cpu: str = _D["register_cpu"],
    register_memory: str = _D["register_memory"],
    node_selector: dict = _D["node_selector"],
    tolerations: list = _D["tolerations"],
    priority_class: str = _D["priority_class"],
    queue: str = _D["queue"],
    gang_scheduler: str = _D["gang_scheduler"],
    trainer_backend: str = _D["trainer_backend"],
    job_ttl_hours: int = _D["job_ttl_hours"],
    job_grace_seconds: int = _D["job_grace_seconds"],
    fabric: str = _D["fabric"],
    rdma_resource: str = _D["rdma_resource"],
    rdma_count: int = _D["rdma_count"],
    network_annotation: str = _D["network_annotation"],
    nccl_env: dict = _D["nccl_env"],
    min_busbw_gbps: float = _D["min_busbw_gbps"],
    tune_algorithm: str = _D["tune_algorithm"],
    tune_parallel: int = _D["tune_parallel"],
    tune_max_failed: int = _D["tune_max_failed"],
    tune_early_stopping: bool = _D["tune_early_stopping"],
):
    run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
    cluster = _Cluster(runtime_image, step_cpu, step_memory, workspace_pvc)
    _cluster_wiring = cluster.wire
    report = summarize(
        platform=platform,
        mlflow_tracking_uri=mlflow_tracking_uri,
        runs_dir=runs_dir,
        experiment_name=experiment_name,
        model_name=model_name,
        namespace=namespace,
        kfp_run_id=run_id,
    ).set_display_name("summary")
    _no_cache(report)
    _cluster_wiring(report, workspace=False)
    with dsl.ExitHandler(report, name="run"):
        pre = preflight(
            platform=platform,
            slurm_partition=slurm_partition,
            slurm_account=slurm_account,
            seed=seed,
            data_source=data_source,
            allow_http_sources=allow_http_sources,
            data_format=data_format,
            text_field=text_field,
            template=template,
            chat_loss=chat_loss,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            packing=packing,
            near_dedup=near_dedup,
            on_error=on_error,
            mask_prompt=mask_prompt,
            num_records=num_records,
            val_fraction=val_fraction,
            vocab_size=vocab_size,
            seq_len=seq_len,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            tune_trials=tune_trials,
            tune_steps=tune_steps,
            train_steps=train_steps,
            batch_size=batch_size,
            learning_rate=learning_rate,
            strategy=strategy,
            precision=precision,
            base_model=base_model,
            lora_r=lora_r,
            nproc_per_node=nproc_per_node,
            num_nodes=num_nodes,
            gate_min_accuracy=gate_min_accuracy,
            force=force,
            pipeline_version=pipeline_version,
            eval_data=eval_data,
            gate_metric=gate_metric,
            gate_margin=gate_margin,
            gate_max_perplexity=gate_max_perplexity,
            gate_guards=gate_guards,
            gate_allow_incomparable=gate_allow_incomparable,
            model_name=model_name,
            experiment_name=experiment_name,
            mlflow_tracking_uri=mlflow_tracking_uri,
            runs_dir=runs_dir,
            namespace=namespace,
            trainer_image=trainer_image,
            serving_image=serving_image,
            serving_runtime=serving_runtime,
            canary_traffic_percent=canary_traffic_percent,
            serving_cpu=serving_cpu,
            serving_memory=serving_memory,
            serving_gpus=serving_gpus,
            serving_min_replicas=serving_min_replicas,
            serving_max_replicas=serving_max_replicas,
            serving_dtype=serving_dtype,
            serving_max_model_len=serving_max_model_len,
            serving_node_selector=serving_node_selector,
            serving_tolerations=serving_tolerations,
            serving_service_account=serving_service_account,
            serving_cluster_local=serving_cluster_local,
            smoke_timeout_seconds=smoke_timeout_seconds,
            workspace_pvc=workspace_pvc,
            job_timeout_minutes=job_timeout_minutes,
            runtime_image=runtime_image,
            gpus_per_node=gpus_per_node,
            job_cpu=job_cpu,
            job_memory=job_memory,
            job_max_restarts=job_max_restarts,
            elastic_min_nodes=elastic_min_nodes,
            elastic_max_restarts=elastic_max_restarts,
            step_cpu=step_cpu,
            step_memory=step_memory,
            shm_size=shm_size,
            evaluate_cpu=evaluate_cpu,
            evaluate_memory=evaluate_memory,
            evaluate_gpus=evaluate_gpus,
            register_cpu=register_cpu,
            register_memory=register_memory,
            node_selector=node_selector,
            tolerations=tolerations,
            priority_class=priority_class,
            queue=queue,
            gang_scheduler=gang_scheduler,
            trainer_backend=trainer_backend,
            job_ttl_hours=job_ttl_hours,
            job_grace_seconds=job_grace_seconds,
            fabric=fabric,
            rdma_resource=rdma_resource,
            rdma_count=rdma_count,
            network_annotation=network_annotation,
            nccl_env=nccl_env,
            min_busbw_gbps=min_busbw_gbps,
            tune_algorithm=tune_algorithm,
            tune_parallel=tune_parallel,
            tune_max_failed=tune_max_failed,
            tune_early_stopping=tune_early_stopping,
            kfp_run_id=run_id,
        )
        _cluster_wiring(pre)
        ctx = {
            "config": pre.outputs["config"],
            "parent_run_id": pre.outputs["parent_run_id"],
            "kfp_run_id": run_id,
        }
        # Cached by its data_spec alone: a run on the same data reuses the dataset.
        data = _cluster_wiring(prepare_data(data_spec=pre.outputs["data_spec"]), workspace=False)
        recorded = _cluster_wiring(
            _no_cache(record_data(**ctx, dataset=data.outputs["dataset"])), workspace=False
        )
        # Nothing new since the champion (same data fingerprint, force=false): stop here.
        with dsl.If(recorded.output == DATA_CHANGED, name="data-changed"):
            tuned = _cluster_wiring(tune(**ctx, dataset=data.outputs["dataset"]))
            trained = _cluster_wiring(
                train(**ctx, dataset=data.outputs["dataset"], hparams=tuned.outputs["Output"])
            )
            scored = _cluster_wiring(
                evaluate(**ctx, model=trained.outputs["model"], dataset=data.outputs["dataset"]),
                workspace=False,
                cpu=evaluate_cpu,
                memory=evaluate_memory,
                gpus=evaluate_gpus,
            )
            with dsl.If(scored.outputs["Output"] == PROMOTE, name="gate"):
                version = _cluster_wiring(
                    _no_cache(register(**ctx, model=trained.outputs["model"])),
                    workspace=False,
                    cpu=register_cpu,
                    memory=register_memory,
                )
                served = _cluster_wiring(
                    _no_cache(
                        deploy(
                            **ctx, model=trained.outputs["model"], version=version.outputs["Output"]
                        )
                    )
                )
                smoke = smoke_test(
                    **ctx,
                    endpoint=served.outputs["Output"],
                    predictions=scored.outputs["predictions"],
                    version=version.outputs["Output"],
                )
                _cluster_wiring(_no_cache(smoke), workspace=False)


def _no_cache(task: dsl.PipelineTask) -> dsl.PipelineTask:
    """Steps that change the world (the registry, the serving endpoint, the run's record)
    run every time: a cached one would report a deployment that did not happen."""
    return task.set_caching_options(False)


def _docstring() -> str:
    args = "\n".join(
        f"    {name}: {field.description}" for name, field in PipelineConfig.model_fields.items()
    )
    return (
        "Train, tune, evaluate, register and serve a causal language model.\n\n"
        f"{SERVICE_ACCOUNT_NOTE}\n\nArgs:\n{args}\n"
    )


llm_train.__doc__ = _docstring()
pipeline = dsl.pipeline(
    name=PIPELINE_NAME,
    description="kubellm: raw text to a served language model (preflight to smoke test).",
)(llm_train)
