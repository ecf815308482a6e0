"""Model FLOPs utilization: achieved training FLOPs over the device's peak.

FLOPs per token follow the PaLM appendix (as torchtitan does): 6·N for the matmuls of
forward and backward over the N non-embedding parameters, plus 12·L·H·Q·T for attention
(L layers, H heads, Q head dim, T sequence length). The peak is the dense bf16 tensor-core
figure of the GPU from its data sheet, or on a CPU a measured float32 matmul rate, so the
number means "share of what this device can do" on either.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Any

import torch

# Dense bf16 peak FLOP/s per device (vendor data sheets, no sparsity).
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H20": 148e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "V100": 125e12,  # fp16 tensor cores (no bf16 on Volta)
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def flops_per_token(
    n_params: int, n_embedding: int, layers: int, heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs per token: 6·N (non-embedding) + 12·L·H·Q·T."""
    return 6.0 * (n_params - n_embedding) + 12.0 * layers * heads * head_dim * seq_len


def model_flops_per_token(model: Any, seq_len: int) -> float:
    """`flops_per_token` of a Hugging Face causal LM (under a PEFT wrapper too)."""
    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    c = base.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = base.get_input_embeddings().weight.numel()
    return flops_per_token(n_params, n_embed, c.num_hidden_layers, heads, head_dim, seq_len)


def gpu_peak(name: str) -> float | None:
    """Peak bf16 FLOP/s of a GPU by its marketing name; None when it is not in the table."""
    for key in sorted(GPU_PEAK_BF16, key=len, reverse=True):  # "H100 SXM" before "H100"
        if key.lower() in name.lower():
            return GPU_PEAK_BF16[key]
    return None


@cache
def cpu_peak(size: int = 512, seconds: float = 0.3) -> float:
    """Measured float32 matmul FLOP/s of this process's CPU threads (best of short runs)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm up the kernels
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - t))
    return best


def device_peak(device: torch.device) -> float | None:
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        return cpu_peak()
    return None
