"""Model FLOPs utilization: achieved training FLOPs over the device's peak.

FLOPs per token follow the PaLM appendix B convention (Chowdhery et al. 2022, "Model FLOPs
Utilization"; torchtitan's `get_num_flop_per_token` is the same formula): the matmuls of
forward and backward, 2 FLOPs per multiply-add, plus 12·L·H·Q·T for attention's own
matmuls (L layers, H query heads, Q head dim, T sequence length). Unlike the 6·(N − embedding)
shorthand, the weights are counted as they are computed, module by module (see
`matmul_params`): every `nn.Linear` the forward runs (the `lm_head` too, tied to the
embedding or not; LoRA's A and B), never the embedding (a gather, not a matmul), 6 per
weight that trains and 4 per frozen one. Model FLOPs, not hardware FLOPs: activation
recomputation is not counted.

The peak is the dense bf16 tensor-core figure of the GPU from its data sheet (exact model and
form factor, from the name `torch.cuda.get_device_name` reports), or on a CPU a measured
float32 matmul rate, so the number means "share of what this device can do" on either.
"""

from __future__ import annotations

import re
import time
from functools import cache
from typing import Any

import torch

# Dense bf16 peak FLOP/s (vendor data sheets, no sparsity), by model and form factor: the
# bare model name is the SXM/OAM (or only) form, " PCIe" and " NVL" the others. `gpu_peak`
# maps a device name onto these keys; a form factor not listed is unknown, never guessed.
GPU_PEAK_BF16: dict[str, float] = {
    "H100": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "H800": 989e12,
    "H800 PCIe": 756e12,
    "H20": 148e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "GB200": 2500e12,
    "B100": 1750e12,
    "A100": 312e12,
    "A100 PCIe": 312e12,
    "A800": 312e12,
    "A800 PCIe": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "V100": 125e12,  # fp16 tensor cores (no bf16 on Volta), SXM2
    "V100 PCIe": 112e12,  # fp16, as above
    "V100S PCIe": 130e12,  # fp16, as above
    "MI300X": 1307e12,
    "MI250X": 383e12,
}
_PEAK_BY_KEY = {key.lower(): peak for key, peak in GPU_PEAK_BF16.items()}
_VENDOR_PREFIXES = ("nvidia ", "tesla ", "amd instinct ", "amd ")
_VARIANTS = ("pcie", "nvl")  # anything else (SXM4, 80GB HBM3, 480GB, ...) is the base form


def flops_per_token(
    *, trainable: int, frozen: int = 0, layers: int, heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs per token: 6·trainable + 4·frozen + 12·L·H·Q·T.

    `trainable` and `frozen` are the matmul weights (the elements of the `nn.Linear`
    weights, embedding lookup excluded) that do and do not require grad. A weight
    multiplies once per token: forward 2 FLOPs, the input gradient 2, and the weight
    gradient 2 only when it trains (PaLM appendix B; torchtitan). A frozen weight is
    assumed to still pay for the input gradient, because something below it trains (LoRA on
    every layer; strictly, the projections that read only frozen embeddings skip it, a
    share under 1/L of the frozen term).

    Attention's own matmuls (Q·Kᵀ and the weights times V, 2·2·T·H·Q in the forward, twice
    that in the backward, with H the query heads: grouped K/V heads do not reduce it) are
    always counted with the full backward, on the same assumption that something upstream
    trains; the causal mask and sliding windows are not discounted, as in PaLM.
    """
    return 6.0 * trainable + 4.0 * frozen + 12.0 * layers * heads * head_dim * seq_len


def _active_adapters(module: Any) -> set[str]:
    """The PEFT adapters a tuner layer runs in its forward (none when disabled or merged)."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return set()
    active = getattr(module, "active_adapters", None) or []
    return {active} if isinstance(active, str) else set(active)


def used_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The `nn.Linear` modules the forward runs, each once (shared modules deduplicated).

    Every `nn.Linear` under `model`, except PEFT per-adapter copies the forward skips:
    under a PEFT tuner layer (`adapter_layer_names`: LoRA's `lora_A`/`lora_B`, a
    `modules_to_save` copy) only the active adapters' entries count, none when adapters
    are disabled or merged into the base weight; a `modules_to_save` wrapper's
    `original_module` does not count while an active copy replaces it.
    """
    seen: set[int] = set()
    found: list[torch.nn.Linear] = []

    def visit(module: torch.nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, torch.nn.Linear):
            found.append(module)
            return
        per_adapter = set(getattr(module, "adapter_layer_names", ()) or ())
        active = _active_adapters(module) if per_adapter else set()
        copies = getattr(module, "modules_to_save", None)
        replaced = isinstance(copies, torch.nn.ModuleDict) and bool(active & set(copies))
        for name, child in module.named_children():
            if name in per_adapter:
                for adapter, sub in child.named_children():
                    if adapter in active:
                        visit(sub)
            elif not (name == "original_module" and replaced):
                visit(child)

    visit(model)
    return found


def matmul_params(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) matmul weight elements per token of `model`, by `used_linears`.

    From the modules' `in_features·out_features`, not the tensors: the same under FSDP2
    (DTensor shards) and with quantized (packed) base weights. A tied `lm_head` counts by
    its own module, once, even though its weight is the embedding's.
    """
    trainable = frozen = 0
    for linear in used_linears(model):
        n = linear.in_features * linear.out_features
        if linear.weight.requires_grad:
            trainable += n
        else:
            frozen += n
    return trainable, frozen


def _hf_config(model: Any) -> Any:
    """The Hugging Face config under PEFT, DDP (`.module`) or `torch.compile` wrappers."""
    for _ in range(8):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        if hasattr(model, "config"):
            return model.config
        inner = getattr(model, "module", None)
        if inner is None:
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    raise TypeError(f"no Hugging Face config found on {type(model).__name__}")


def model_flops_per_token(model: Any, seq_len: int) -> float:
    """`flops_per_token` of a Hugging Face causal LM (plain, PEFT, DDP or FSDP2-wrapped).

    The weights from `matmul_params`; L, H and Q from the config (`head_dim`, else
    hidden_size / num_attention_heads).
    """
    c = _hf_config(model)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    trainable, frozen = matmul_params(model)
    return flops_per_token(
        trainable=trainable,
        frozen=frozen,
        layers=c.num_hidden_layers,
        heads=heads,
        head_dim=head_dim,
        seq_len=seq_len,
    )


def gpu_key(name: str) -> str:
    """The `GPU_PEAK_BF16` key a device name maps to, lowercased ("" for a blank name).

    Case and spacing do not matter; the vendor prefix ("NVIDIA ", "Tesla ", "AMD Instinct ")
    goes; the model is the first token (up to a space or hyphen), matched exactly, so
    "GB200" is not "B200", "L40" not "L4", "A10" not "A100"; the form factor is " pcie" or
    " nvl" when one of the remaining tokens says so, else the base (SXM) form, so a memory
    size or "SXM4" suffix does not matter: "NVIDIA A100-SXM4-80GB" → "a100",
    "NVIDIA H200 NVL" → "h200 nvl", "NVIDIA A100 80GB PCIe" → "a100 pcie".
    """
    s = " ".join(name.split()).lower()
    stripped = True
    while stripped:
        stripped = False
        for prefix in _VENDOR_PREFIXES:
            if s.startswith(prefix):
                s, stripped = s[len(prefix) :].lstrip(), True
    tokens = [t for t in re.split(r"[\s\-]+", s) if t]
    if not tokens:
        return ""
    variant = next((v for v in _VARIANTS if v in tokens[1:]), None)
    return f"{tokens[0]} {variant}" if variant else tokens[0]


def gpu_peak(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU by its device name; None when it is not in the table."""
    return _PEAK_BY_KEY.get(gpu_key(name))


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


def peak_or_reason(device: torch.device) -> tuple[float | None, str]:
    """The device's peak FLOP/s and one log line saying where it comes from.

    (peak, "mfu: peak ... for ...") when known; (None, "mfu: no bf16 peak known for
    device ...; MFU not reported (...)") when not, for the trainer to print once.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name)
        if peak is None:
            return None, (
                f"mfu: no bf16 peak known for device {name!r}; MFU not reported "
                "(add it to kubellm.train.mfu.GPU_PEAK_BF16)"
            )
        return peak, f"mfu: peak {peak / 1e12:g} TFLOP/s (dense bf16 data sheet) for {name!r}"
    if device.type == "cpu":
        peak = cpu_peak()
        return peak, f"mfu: peak {peak / 1e9:.1f} GFLOP/s (measured float32 matmul) on the CPU"
    return None, (
        f"mfu: no peak known for device type {device.type!r}; MFU not reported "
        "(add it to kubellm.train.mfu)"
    )


def device_peak(device: torch.device) -> float | None:
    """The device's peak FLOP/s (`peak_or_reason` without the line); None when unknown."""
    return peak_or_reason(device)[0]
