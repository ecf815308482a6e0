"""Device-correct training code, checked without a GPU.

The `meta` device stands in for CUDA: arithmetic that mixes a meta tensor with a CPU tensor
fails here exactly as a CUDA/CPU mix fails on a GPU (e.g. the evaluation's loss sum, which
once built its count on the CPU and so crashed every GPU run after training).
"""

from __future__ import annotations

import pytest
import torch

from kubellm.config import ModelConfig, TrainConfig
from kubellm.train.loop import weighted
from kubellm.train.model import build_model


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_loss_sum_stays_on_the_losss_device(device: str) -> None:
    loss = torch.tensor(1.5, device=device)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    total += weighted(loss, 4)  # a CPU tensor in here raises on meta (and on CUDA)
    assert total.device.type == device and total.dtype == torch.float64
    if device == "cpu":
        assert total.tolist() == [6.0, 4.0]


def test_a_cpu_tensor_in_the_sum_is_caught_on_meta() -> None:
    """The check above can fail: the old construction raises on a non-CPU loss."""
    loss = torch.tensor(1.5, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        torch.stack([loss.double() * 4, torch.tensor(4).double()])


def test_training_models_build_no_kv_cache(tmp_path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")),
        unk_token="<unk>",
        eos_token="<unk>",
        pad_token="<unk>",
    )
    cfg = TrainConfig(
        dataset_dir=str(tmp_path),
        output_dir=str(tmp_path / "out"),
        model=ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
    )
    model = build_model(cfg, tok)
    assert model.config.use_cache is False
    out = model(input_ids=torch.tensor([[1, 1, 1]]), labels=torch.tensor([[1, 1, 1]]))
    assert out.past_key_values is None  # no per-layer K/V concatenation while training
