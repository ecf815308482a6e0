"""The MFU arithmetic: FLOPs per token and the device peaks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kubellm.train import mfu

# A tiny Llama with grouped K/V heads: V vocab, H hidden, FF MLP, L layers, NH query heads,
# NKV K/V heads. The FLOPs below are counted by hand from these numbers.
V, H, FF, L, NH, NKV = 96, 32, 56, 2, 4, 2
T = 16  # sequence length


def tiny_llama(tied: bool, head_dim: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    extra: dict[str, Any] = {} if head_dim is None else {"head_dim": head_dim}
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=V,
        hidden_size=H,
        intermediate_size=FF,
        num_hidden_layers=L,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        tie_word_embeddings=tied,
        **extra,
    )
    return LlamaForCausalLM(config)


def layer_weights(hd: int) -> int:
    """q, k, v, o (grouped K/V) and the gate/up/down MLP of one decoder layer."""
    q = o = H * NH * hd
    k = v = H * NKV * hd
    return q + k + v + o + 3 * H * FF


def test_flops_per_token_is_6_trainable_4_frozen_plus_attention() -> None:
    fpt = mfu.flops_per_token(trainable=1000, frozen=300, layers=2, heads=4, head_dim=8, seq_len=16)
    assert fpt == 6 * 1000 + 4 * 300 + 12 * 2 * 4 * 8 * 16
    assert (
        mfu.flops_per_token(trainable=1000, layers=2, heads=4, head_dim=8, seq_len=16)
        == 6 * 1000 + 12 * 2 * 4 * 8 * 16
    )
    with pytest.raises(TypeError):  # the old positional form must not silently mean this
        mfu.flops_per_token(1000, 300, 2, 4, 8, 16)  # type: ignore[misc]


def test_7b_like_counts_linears_and_lm_head_not_embedding_or_norms() -> None:
    # Llama-2-7B: 6_738_415_616 parameters = embedding 32000·4096 + 32 layers of
    # (4·4096² + 3·4096·11008) + lm_head 32000·4096 + RMSNorm weights 65·4096.
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616
    linears = 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096
    assert linears == 6_738_415_616 - 131_072_000 - 65 * 4096
    assert mfu.matmul_params(model) == (linears, 0)
    expected = 6 * linears + 12 * 32 * 32 * 128 * 4096
    assert mfu.model_flops_per_token(model, 4096) == expected
    assert expected == mfu.flops_per_token(
        trainable=linears, layers=32, heads=32, head_dim=128, seq_len=4096
    )


@pytest.mark.parametrize("head_dim", [None, 12])  # H / NH = 8, or set apart from it
@pytest.mark.parametrize("tied", [True, False])
def test_full_training_counts_every_linear_once_at_6(tied: bool, head_dim: int | None) -> None:
    model = tiny_llama(tied, head_dim)
    hd = head_dim or H // NH
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    weights = L * layer_weights(hd) + V * H  # lm_head once; the input embedding never
    assert mfu.matmul_params(model) == (weights, 0)
    assert mfu.model_flops_per_token(model, T) == 6 * weights + 12 * L * NH * hd * T


def test_tied_and_untied_cost_the_same() -> None:
    # The old 6·(N − embedding) dropped the tied lm_head: N deduplicates the shared weight.
    assert mfu.model_flops_per_token(tiny_llama(True), T) == mfu.model_flops_per_token(
        tiny_llama(False), T
    )


def lora_weights(r: int, hd: int) -> int:
    """LoRA on q_proj and v_proj: A is r×H, B is (out)×r, per layer."""
    return L * ((H * r + r * NH * hd) + (H * r + r * NKV * hd))


@pytest.mark.parametrize("tied", [True, False])
def test_lora_counts_frozen_base_at_4_and_adapters_at_6(tied: bool) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(tied), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    hd = H // NH
    frozen = L * layer_weights(hd) + V * H
    trainable = lora_weights(4, hd)
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert mfu.matmul_params(model) == (trainable, frozen)
    assert mfu.model_flops_per_token(model, T) == (
        6 * trainable + 4 * frozen + 12 * L * NH * hd * T
    )


def test_lora_counts_only_what_the_forward_runs() -> None:
    from peft import LoraConfig, get_peft_model

    hd = H // NH
    model: Any = get_peft_model(
        tiny_llama(False),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    )
    # lm_head: its trainable copy runs, not the frozen original
    frozen, trainable = L * layer_weights(hd), lora_weights(4, hd) + V * H
    assert mfu.matmul_params(model) == (trainable, frozen)
    # a second adapter, loaded but not active, costs nothing
    model.add_adapter("other", LoraConfig(r=8, target_modules=["k_proj", "o_proj"]))
    assert mfu.matmul_params(model) == (trainable, frozen)
    # adapters disabled: the base model alone (frozen)
    with model.disable_adapter():
        assert mfu.matmul_params(model) == (0, L * layer_weights(hd) + V * H)


def test_old_call_from_loop_still_works_under_ddp_like_wrapper() -> None:
    class Wrapper(torch.nn.Module):  # DDP's shape: the model under `.module`
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    model = tiny_llama(True)
    assert mfu.model_flops_per_token(Wrapper(model), T) == mfu.model_flops_per_token(model, T)


# Every name `torch.cuda.get_device_name` reports for the devices in the table.
PEAKS = [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA H800", 989e12),
    ("NVIDIA H800 PCIe", 756e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA GH200 144G HBM3e", 989e12),
    ("NVIDIA B200", 2250e12),
    ("NVIDIA GB200", 2500e12),
    ("NVIDIA B100", 1750e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA A800-SXM4-80GB", 312e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", 181e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA A10G", 70e12),
    ("NVIDIA A10", 125e12),
    ("Tesla V100-SXM2-32GB", 125e12),
    ("Tesla V100-PCIE-16GB", 112e12),
    ("NVIDIA H20", 148e12),
    ("AMD Instinct MI300X", 1307e12),
    ("AMD Instinct MI250X", 383e12),
]


@pytest.mark.parametrize(("name", "peak"), PEAKS)
def test_gpu_peaks_by_device_name(name: str, peak: float) -> None:
    assert mfu.gpu_peak(name) == peak


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("  nvidia   h200   nvl ", 835e12),
        ("NVIDIA\tH100\tPCIe", 756e12),
        ("nvidia a100-pcie-40gb", 312e12),
        ("H100 NVL", 835e12),  # no vendor prefix
        ("NVIDIA GB200 ", 2500e12),
        ("amd instinct mi300x", 1307e12),
    ],
)
def test_gpu_peak_ignores_case_and_spacing(name: str, peak: float) -> None:
    assert mfu.gpu_peak(name) == peak


@pytest.mark.parametrize(
    ("name", "not_this"),
    [
        ("NVIDIA GB200", "B200"),
        ("NVIDIA H200 NVL", "H200"),
        ("NVIDIA H100 NVL", "H100"),
        ("NVIDIA L40", "L4"),
        ("NVIDIA A10", "A100"),
        ("NVIDIA GH200 480GB", "H200"),
        ("NVIDIA H20", "H200"),
    ],
)
def test_gpu_peak_never_matches_another_model_by_substring(name: str, not_this: str) -> None:
    key = mfu.gpu_key(name)
    assert key != not_this.lower()
    assert mfu.gpu_peak(name) == dict(PEAKS)[name]


@pytest.mark.parametrize(
    "name",
    [
        "Some Future GPU",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA H300",
        "NVIDIA B20",
        "NVIDIA L4S",
        "NVIDIA H800 NVL",  # a form factor not in the table is unknown, not the SXM figure
        "AMD Instinct MI250X/MI250",
        "",
        "NVIDIA",
    ],
)
def test_unknown_gpu_has_no_peak(name: str) -> None:
    assert mfu.gpu_peak(name) is None


def test_unknown_gpu_is_one_log_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA X")
    peak, line = mfu.peak_or_reason(torch.device("cuda"))
    assert peak is None
    assert line == (
        "mfu: no bf16 peak known for device 'NVIDIA X'; MFU not reported "
        "(add it to kubellm.train.mfu.GPU_PEAK_BF16)"
    )
    assert mfu.device_peak(torch.device("cuda")) is None


def test_known_gpu_says_its_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200 NVL")
    peak, line = mfu.peak_or_reason(torch.device("cuda", 0))
    assert peak == 835e12
    assert line == "mfu: peak 835 TFLOP/s (dense bf16 data sheet) for 'NVIDIA H200 NVL'"
    assert mfu.device_peak(torch.device("cuda", 0)) == 835e12


def test_other_device_types_have_no_peak() -> None:
    peak, line = mfu.peak_or_reason(torch.device("meta"))
    assert peak is None
    assert "MFU not reported" in line and "'meta'" in line


def test_cpu_peak_is_measured() -> None:
    peak = mfu.cpu_peak()
    assert 1e8 < peak < 1e13  # a CPU does between 0.1 GFLOP/s and 10 TFLOP/s in fp32
    assert mfu.device_peak(torch.device("cpu")) == peak  # measured once per process
    assert mfu.peak_or_reason(torch.device("cpu")) == (
        peak,
        f"mfu: peak {peak / 1e9:.1f} GFLOP/s (measured float32 matmul) on the CPU",
    )
