"""Greedy completion of prompts, shared by evaluate and the model server.

Prompts are grouped by token length, so no batch carries padding. Both callers default to
one prompt per forward pass: a CPU matmul's rounding can depend on the batch size, and the
smoke test compares the served answers with the evaluated ones token for token.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from kubellm.data.tokenizer import load_tokenizer
from kubellm.serve.layout import model_paths


def load_model(model_dir: str | Path, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """Load a model directory (safetensors only) and its tokenizer, eval mode: a Hugging Face
    directory or a registered MLflow transformers model (kubellm.serve.layout)."""
    weights, tokenizer = model_paths(model_dir)
    if not (weights / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory: config.json is missing")
    model = AutoModelForCausalLM.from_pretrained(
        str(weights), use_safetensors=True, trust_remote_code=trust_remote_code
    )
    model.eval()
    return model, load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)


@torch.no_grad()
def complete(
    model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int = 8, batch_size: int = 1
) -> list[str]:
    """Greedy completions, cut at EOS, stripped."""
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_len[len(ids)].append(i)
    out: list[str] = [""] * len(prompts)
    for length, members in by_len.items():
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            if length == 0:
                continue
            x = torch.tensor([encoded[i] for i in chunk], dtype=torch.long)
            gen = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            texts = tokenizer.batch_decode(gen[:, length:], skip_special_tokens=True)
            for i, text in zip(chunk, texts, strict=True):
                out[i] = text.strip()
    return out
