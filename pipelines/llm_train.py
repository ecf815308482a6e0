"""The kubellm DAG: preflight → prepare_data → tune → train → evaluate → [gate] → register →
deploy → smoke_test, inside an exit handler that stops run-scoped servers and writes a summary.

Compile (the committed llm_train.yaml must match; a test checks it):

    kubellm compile

The parameters are exactly kubellm.config.PipelineConfig's fields, with its defaults and
descriptions; preflight validates them all before anything expensive starts.
"""

import sys
from pathlib import Path

from kfp import dsl, kubernetes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.deploy import deploy
from components.evaluate import evaluate
from components.preflight import preflight
from components.prepare_data import prepare_data
from components.register import register
from components.smoke_test import smoke_test
from components.summarize import summarize
from components.train import train
from components.tune import tune
from kubellm.backends.base import WORKSPACE_MOUNT
from kubellm.config import PipelineConfig
from kubellm.stages.evaluate import PROMOTE

PIPELINE_NAME = "kubellm-llm-train"
SERVICE_ACCOUNT_NOTE = "Steps run as the kubellm-pipeline ServiceAccount (manifests/base)."
CONFIG_MAP = "kubellm-config"
MLFLOW_SECRET = "mlflow-credentials"

_D = {name: field.default for name, field in PipelineConfig.model_fields.items()}


def _cluster_wiring(task: dsl.PipelineTask, workspace: bool = True) -> dsl.PipelineTask:
    """Cluster-side settings: the tracking URI from a ConfigMap, optional credentials from a
    Secret (never a pipeline parameter), and the shared workspace volume."""
    kubernetes.use_config_map_as_env(
        task,
        config_map_name=CONFIG_MAP,
        config_map_key_to_env={"MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI"},
    )
    kubernetes.use_secret_as_env(
        task,
        secret_name=MLFLOW_SECRET,
        secret_key_to_env={
            "username": "MLFLOW_TRACKING_USERNAME",
            "password": "MLFLOW_TRACKING_PASSWORD",
        },
        optional=True,
    )
    if workspace:
        kubernetes.mount_pvc(task, pvc_name=_D["workspace_pvc"], mount_path=WORKSPACE_MOUNT)
    return task


def llm_train(
    platform: str = _D["platform"],
    seed: int = _D["seed"],
    data_source: str = _D["data_source"],
    data_format: str = _D["data_format"],
    text_field: str = _D["text_field"],
    template: str = _D["template"],
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
    model_name: str = _D["model_name"],
    experiment_name: str = _D["experiment_name"],
    mlflow_tracking_uri: str = _D["mlflow_tracking_uri"],
    runs_dir: str = _D["runs_dir"],
    namespace: str = _D["namespace"],
    trainer_image: str = _D["trainer_image"],
    serving_image: str = _D["serving_image"],
    workspace_pvc: str = _D["workspace_pvc"],
    job_timeout_minutes: int = _D["job_timeout_minutes"],
):
    run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
    report = summarize(
        platform=platform,
        mlflow_tracking_uri=mlflow_tracking_uri,
        runs_dir=runs_dir,
        experiment_name=experiment_name,
        model_name=model_name,
        kfp_run_id=run_id,
    ).set_display_name("summary")
    _cluster_wiring(report, workspace=False)
    with dsl.ExitHandler(report, name="run"):
        pre = preflight(
            platform=platform,
            seed=seed,
            data_source=data_source,
            data_format=data_format,
            text_field=text_field,
            template=template,
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
            model_name=model_name,
            experiment_name=experiment_name,
            mlflow_tracking_uri=mlflow_tracking_uri,
            runs_dir=runs_dir,
            namespace=namespace,
            trainer_image=trainer_image,
            serving_image=serving_image,
            workspace_pvc=workspace_pvc,
            job_timeout_minutes=job_timeout_minutes,
            kfp_run_id=run_id,
        )
        _cluster_wiring(pre)
        ctx = {
            "config": pre.outputs["config"],
            "parent_run_id": pre.outputs["parent_run_id"],
            "kfp_run_id": run_id,
        }
        data = _cluster_wiring(prepare_data(**ctx), workspace=False)
        tuned = _cluster_wiring(tune(**ctx, dataset=data.outputs["dataset"]))
        trained = _cluster_wiring(
            train(**ctx, dataset=data.outputs["dataset"], hparams=tuned.outputs["Output"])
        )
        scored = _cluster_wiring(
            evaluate(**ctx, model=trained.outputs["model"], dataset=data.outputs["dataset"]),
            workspace=False,
        )
        with dsl.If(scored.outputs["Output"] == PROMOTE, name="gate"):
            version = _cluster_wiring(
                register(**ctx, model=trained.outputs["model"]), workspace=False
            )
            served = _cluster_wiring(
                deploy(**ctx, model=trained.outputs["model"], version=version.outputs["Output"])
            )
            smoke = smoke_test(
                **ctx,
                endpoint=served.outputs["Output"],
                predictions=scored.outputs["predictions"],
                version=version.outputs["Output"],
            )
            _cluster_wiring(smoke, workspace=False)


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
