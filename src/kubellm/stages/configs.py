"""PipelineConfig -> stage configs: the one place a pipeline parameter meets a stage's config.

`kubellm prepare` / `kubellm train` by hand and the pipeline's stages use these same
functions, so a parameter means the same thing everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubellm.config import LoraSettings, ModelConfig, PipelineConfig, TrainConfig
from kubellm.data.prepare import PrepareParams


def prepare_params(cfg: PipelineConfig) -> PrepareParams:
    """The data stage's slice of the pipeline parameters."""
    return PrepareParams(
        source=cfg.data_source,
        format=cfg.data_format,
        text_field=cfg.text_field,
        template=cfg.template,
        tokenizer=cfg.tokenizer or cfg.base_model,  # a base model brings its tokenizer
        trust_remote_code=cfg.trust_remote_code,
        packing=cfg.packing,
        near_dedup=cfg.near_dedup,
        on_error=cfg.on_error,
        mask_prompt=cfg.mask_prompt,
        num_records=cfg.num_records,
        seed=cfg.seed,
        val_fraction=cfg.val_fraction,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
    )


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
    `values` are the job's own settings (steps, checkpointing, ...)."""
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
    )
    return base.with_values(values)
