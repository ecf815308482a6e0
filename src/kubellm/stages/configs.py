"""PipelineConfig -> stage configs: the one place a pipeline parameter meets a stage's config.

`kubellm prepare` / `kubellm train` by hand and the pipeline's stages use these same
functions, so a parameter means the same thing everywhere.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubellm.config import LoraSettings, ModelConfig, PipelineConfig, TrainConfig

if TYPE_CHECKING:
    # the data library (pyarrow, tokenizers, transformers) is the [train] extra's; the
    # core (`kubellm render`, `kubellm submit`) imports this module without it
    from kubellm.data.prepare import PrepareParams


def prepare_params(cfg: PipelineConfig) -> PrepareParams:
    """The data stage's slice of the pipeline parameters."""
    from kubellm.data.prepare import PrepareParams

    return PrepareParams(
        source=cfg.data_source,
        format=cfg.data_format,
        text_field=cfg.text_field,
        template=cfg.template,
        chat_loss=cfg.chat_loss,
        tokenizer=cfg.tokenizer or cfg.base_model,  # a base model brings its tokenizer
        trust_remote_code=cfg.trust_remote_code,
        packing=cfg.packing,
        near_dedup=cfg.near_dedup,
        on_error=cfg.on_error,
        allow_http=cfg.allow_http_sources,
        mask_prompt=cfg.mask_prompt,
        num_records=cfg.num_records,
        seed=cfg.seed,
        val_fraction=cfg.val_fraction,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
    )


def data_spec(cfg: PipelineConfig) -> str:
    """prepare_data's one input, and so its KFP cache key (the key is the task's input
    values, image and command): the data parameters plus a stamp of every source file
    (size, mtime or ETag). Two runs with the same data reuse the dataset on a cluster;
    new files at the same URI make a new key. Nothing run-specific (no run id, no
    training setting) belongs here, or nothing would ever be reused."""
    from kubellm.data.sources import source_stamp

    params = asdict(prepare_params(cfg))
    spec = {"params": params, "source_stamp": source_stamp(cfg.data_source, cfg.allow_http_sources)}
    if params["tokenizer"] and Path(params["tokenizer"]).exists():  # a local tokenizer folder
        spec["tokenizer_stamp"] = source_stamp(params["tokenizer"])
    return json.dumps(spec, sort_keys=True)


def spec_params(spec: str) -> PrepareParams:
    """The PrepareParams a data_spec carries."""
    from kubellm.data.prepare import PrepareParams

    return PrepareParams(**json.loads(spec)["params"])


def model_shape(cfg: PipelineConfig) -> ModelConfig:
    """The from-config model the pipeline's shape parameters describe."""
    return ModelConfig(
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        intermediate_size=cfg.hidden_size * 2,
        max_position_embeddings=max(128, cfg.seq_len),
    )


def train_config(
    cfg: PipelineConfig, dataset_dir: str | Path, output_dir: str | Path, **values: Any
) -> TrainConfig:
    """The TrainConfig of a training job (a trial or the final run) of this pipeline run;
    `values` are the job's own settings (steps, checkpointing, ...).

    A run that asks for GPUs (gpus_per_node > 0) demands nccl: `auto` would fall back to
    gloo on a node whose driver is too old for the image's CUDA and train on its CPUs
    without a word; with nccl the ranks stop at once and say why (kubellm.train.loop.check).
    The pipeline has no backend parameter, so no run asks for gloo with GPUs; `kubellm
    train` by hand takes any backend (`--set backend=gloo`).
    """
    base = TrainConfig(
        dataset_dir=str(dataset_dir),
        output_dir=str(output_dir),
        batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        seed=cfg.seed,
        model=model_shape(cfg),
        model_name_or_path=cfg.base_model,
        trust_remote_code=cfg.trust_remote_code,
        strategy=cfg.strategy,
        precision=cfg.precision,
        lora=LoraSettings(r=cfg.lora_r) if cfg.lora_r else None,
        mlflow_tracking_uri=cfg.mlflow_tracking_uri,
        backend="nccl" if cfg.gpus_per_node else "auto",
    )
    return base.with_values(values)
