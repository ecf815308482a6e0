"""The prepare_data stage: build the Dataset artifact and log its counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubellm.config import PipelineConfig
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.stage import StageContext


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


def run_prepare(ctx: StageContext, out_dir: str | Path) -> dict[str, Any]:
    params = prepare_params(ctx.cfg)
    with ctx.tracker.stage(ctx.parent_run_id, "prepare_data") as run_id:
        manifest = prepare(params, out_dir)
        rec = manifest["records"]
        metrics = {
            "records_read": rec["read"],
            "records_kept": rec["kept"],
            "tokens_train": manifest["tokens"]["train"],
            "tokens_val": manifest["tokens"]["val"],
            **{f"dropped_{k}": v for k, v in rec["dropped"].items()},
        }
        ctx.tracker.log(
            run_id,
            metrics=metrics,
            params=vars(params),
            tags={"kubellm.data_fingerprint": manifest["source_fingerprint"]},
        )
    return manifest
