"""Greedy completion of prompts in-process: what evaluate reports, and what the smoke test
compares the served answers with (the server itself generates in kubellm.serve.engine).

Prompts are grouped by token length, so no batch carries padding. Callers default to one
prompt per forward pass: a CPU matmul's rounding can depend on the batch size, and the smoke
test compares the served answers with the evaluated ones token for token, excusing only
near-ties (`greedy_with_margins`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from kubellm.data.tokenizer import load_tokenizer
from kubellm.serve.layout import model_paths


def load_model(
    model_dir: str | Path,
    trust_remote_code: bool = False,
    device: str | None = None,
    dtype: str | None = None,
) -> tuple[Any, Any]:
    """Load a model directory (safetensors only) and its tokenizer, eval mode: a Hugging Face
    directory or a registered MLflow transformers model (kubellm.serve.layout); on `device`
    when given (callers here pass their tensors on `model.device`); in `dtype` ("float32",
    "bfloat16", "float16") when given, else the checkpoint's own."""
    weights, tokenizer = model_paths(model_dir)
    if not (weights / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory: config.json is missing")
    extra: dict[str, Any] = {}
    if dtype is not None:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
            raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype")
        extra["dtype"] = torch_dtype
    model = AutoModelForCausalLM.from_pretrained(
        str(weights), use_safetensors=True, trust_remote_code=trust_remote_code, **extra
    )
    model.eval()
    if device is not None:
        model.to(torch.device(device))  # type: ignore[arg-type]  # transformers stubs
    return model, load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)


def _greedy(model: Any, tokenizer: Any, x: torch.Tensor, max_new: int, **extra: Any) -> Any:
    """model.generate, greedy, on unpadded prompts `x` (every row real tokens), to EOS."""
    return model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


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
            x = torch.tensor([encoded[i] for i in chunk], dtype=torch.long, device=model.device)
            gen = _greedy(model, tokenizer, x, max_new_tokens)
            texts = tokenizer.batch_decode(gen[:, length:], skip_special_tokens=True)
            for i, text in zip(chunk, texts, strict=True):
                out[i] = text.strip()
    return out


@torch.no_grad()
def greedy_with_margins(
    model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int = 8
) -> list[tuple[str, float]]:
    """What `complete` returns (one prompt per forward pass), each with the smallest gap
    between its top two logits over the generated steps (inf when nothing was generated).

    A server that batches requests may flip a token where that gap is within rounding (about
    1e-4); callers comparing served answers with these excuse such near-ties.
    """
    out: list[tuple[str, float]] = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            out.append(("", math.inf))
            continue
        x = torch.tensor([ids], dtype=torch.long, device=model.device)
        gen = _greedy(
            model, tokenizer, x, max_new_tokens, output_logits=True, return_dict_in_generate=True
        )
        margin = math.inf
        for step in gen.logits:  # raw logits, one [1, vocab] tensor per generated token
            top2 = step[0].float().topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
        text = tokenizer.decode(gen.sequences[0, len(ids) :], skip_special_tokens=True)
        out.append((text.strip(), margin))
    return out
