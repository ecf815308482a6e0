"""A tiny, untrained Llama-style model directory built here, without a download.

Tests that serve or register a model check plumbing and determinism, not accuracy, so a
random model is enough. The weights are drawn wider than the default init so greedy
completions differ from prompt to prompt (the default init answers every prompt the same way,
which would let a mix-up between prompts go unnoticed).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kubellm.config import ModelConfig
from kubellm.data.synthetic import arithmetic_records
from kubellm.data.tokenizer import train_bpe
from kubellm.train.model import new_llama

SHAPE = ModelConfig(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=64
)


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write a Hugging Face model directory (config.json, safetensors, tokenizer) to out_dir."""
    texts = [r["text"] for r in arithmetic_records(400, seed=seed)]
    tokenizer = train_bpe(texts, vocab_size=300)
    torch.manual_seed(seed)
    model = new_llama(SHAPE, tokenizer)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
