"""The MFU arithmetic: FLOPs per token and the device peaks."""

from __future__ import annotations

import pytest
import torch

from kubellm.train import mfu


def test_flops_per_token_is_6n_plus_attention() -> None:
    # 7B-like: N=6.5e9 non-embedding, 32 layers, 32 heads of 128, T=4096
    fpt = mfu.flops_per_token(6_738_415_616, 131_072_000, 32, 32, 128, 4096)
    assert fpt == 6 * (6_738_415_616 - 131_072_000) + 12 * 32 * 32 * 128 * 4096


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("Some Future GPU", None),
    ],
)
def test_gpu_peaks_by_name(name: str, peak: float | None) -> None:
    assert mfu.gpu_peak(name) == peak


def test_cpu_peak_is_measured() -> None:
    peak = mfu.cpu_peak()
    assert 1e8 < peak < 1e13  # a CPU does between 0.1 GFLOP/s and 10 TFLOP/s in fp32
    assert mfu.device_peak(torch.device("cpu")) == peak  # measured once per process
