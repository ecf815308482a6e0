"""Helpers of the training tests: a tiny config, config files, the printed losses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubellm.config import TrainConfig
from kubellm.data.tokenizer import load_tokenizer
from kubellm.train.metric_lines import parse_metrics

TINY_MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def tiny_config(dataset: Path, output_dir: Path, **values: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "dataset_dir": str(dataset),
        "output_dir": str(output_dir),
        "steps": 8,
        "batch_size": 8,
        "log_every": 1,
        "eval_batches": 2,
        "model": TINY_MODEL,
    }
    return TrainConfig.model_validate({**base, **values})


def write_config(path: Path, cfg: TrainConfig) -> Path:
    path.write_text(json.dumps(cfg.model_dump()))
    return path


def step_losses(logs: str) -> dict[int, str]:
    """step -> the loss exactly as printed (6 significant digits, all-reduced over ranks)."""
    out = {}
    for line in logs.splitlines():
        m = parse_metrics(line)
        if "step" in m and "loss" in m:
            out[int(m["step"])] = line.split("loss=")[1].split()[0]
    return out


def save_llama(
    dataset: Path,
    out: Path,
    *,
    seed: int,
    tie: bool,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 2,
    **kw: Any,
) -> Path:
    """A tiny 'pretrained' Llama with the dataset's vocabulary, saved with save_pretrained
    (safetensors; `kw` goes to save_pretrained, e.g. max_shard_size)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(load_tokenizer(dataset / "tokenizer")),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    LlamaForCausalLM(config).save_pretrained(out, **kw)
    return out
