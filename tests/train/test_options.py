"""Training options, in one process (fast) and composed under torchrun (FSDP2 + LoRA + more)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainkit import TINY_MODEL, save_llama, step_losses, tiny_config, write_config
from transformers import AutoModelForCausalLM

from kubellm.backends.base import TrainJob
from kubellm.backends.local.torchrun import TorchrunTrainer
from kubellm.config import ConfigError, TrainConfig
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.train.loop import check, load_config, train
from kubellm.train.model import build_model


def _train(cfg: TrainConfig, capsys: pytest.CaptureFixture[str]) -> tuple[dict, dict[int, str]]:
    final = train(cfg)
    out = capsys.readouterr().out
    return final, step_losses(out)


@pytest.fixture(scope="module")
def unmasked_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every token is a target, so a micro-batch mean is a fixed share of the batch mean."""
    out = tmp_path_factory.mktemp("unmasked")
    prepare(PrepareParams(num_records=1000, vocab_size=300, seq_len=16, mask_prompt=False), out)
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 'pretrained' model directory (safetensors) with the dataset's vocabulary."""
    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    return save_llama(tiny_dataset, out, seed=1, tie=False)


def test_gradient_accumulation_matches_one_big_batch(
    unmasked_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        _train(
            tiny_config(unmasked_dataset, tmp_path / f"m{k}", steps=4, grad_accum_steps=k), capsys
        )
        for k in (1, 4)
    ]
    (_, one), (_, four) = runs
    assert len(one) == 4
    for step in one:
        assert float(four[step]) == pytest.approx(float(one[step]), rel=1e-5)
    a, b = (
        load_file(tmp_path / "m1" / "model.safetensors"),
        load_file(tmp_path / "m4" / "model.safetensors"),
    )
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_activation_checkpointing_and_compile_do_not_change_the_numbers(
    tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _train(tiny_config(tiny_dataset, tmp_path / "a", steps=3), capsys)[1]
    ac = _train(
        tiny_config(tiny_dataset, tmp_path / "b", steps=3, activation_checkpointing=True), capsys
    )[1]
    assert ac == base  # recomputation is exact in fp32
    compiled = _train(tiny_config(tiny_dataset, tmp_path / "c", steps=3, compile=True), capsys)[1]
    for step in base:
        assert float(compiled[step]) == pytest.approx(float(base[step]), rel=1e-4)
    exported = json.loads((tmp_path / "b" / "config.json").read_text())
    assert exported.get("use_cache", True) is True  # turned back on for inference


def test_bf16_autocast_runs_on_cpu_when_asked(
    tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final = train(tiny_config(tiny_dataset, tmp_path / "m", steps=3, precision="bf16"))
    out = capsys.readouterr().out
    assert "precision=bf16" in out
    assert 0 < final["eval_loss"] < 20
    weights = load_file(tmp_path / "m" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())  # fp32 master weights


def test_lora_on_a_pretrained_model_trains_adapters_and_exports_them_merged(
    tiny_dataset: Path, hf_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config(
        tiny_dataset,
        tmp_path / "m",
        steps=4,
        model_name_or_path=str(hf_model),
        learning_rate=0.05,
        lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
    )
    train(cfg)
    out = capsys.readouterr().out
    params = int(out.split("params=")[1].split()[0])
    trainable = int(out.split("trainable=")[1].split()[0])
    assert 0 < trainable < params / 4
    base = load_file(hf_model / "model.safetensors")
    tuned = load_file(tmp_path / "m" / "model.safetensors")
    assert tuned.keys() == base.keys()  # merged: no lora_A / lora_B left, same names
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(tuned[q], base[q])  # the merged adapter moved it
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(tuned[k], base[k])  # not a target: frozen
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", use_safetensors=True)
    assert model.config.num_hidden_layers == 2


def test_fsdp_with_lora_accumulation_and_activation_checkpointing_under_torchrun(
    tiny_dataset: Path, hf_model: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(
        tiny_dataset,
        tmp_path / "m",
        steps=4,
        strategy="fsdp",
        model_name_or_path=str(hf_model),
        lora={"r": 4},
        grad_accum_steps=2,
        activation_checkpointing=True,
    )
    job = TrainJob(
        name="fsdp-lora",
        train_args=["--config", str(write_config(tmp_path / "c.json", cfg))],
        nproc_per_node=2,
    )
    result = TorchrunTrainer(echo=False).run(job)
    assert "strategy=fsdp" in result.logs and "micro_batch=2" in result.logs
    assert result.metrics["step"] == 4
    tuned = load_file(tmp_path / "m" / "model.safetensors")
    assert tuned.keys() == load_file(hf_model / "model.safetensors").keys()


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"batch_size": 8, "grad_accum_steps": 3}, "invalid batch_size=8"),
        ({"dataset_dir": "/nonexistent"}, "invalid dataset_dir='/nonexistent'"),
        ({"model": {**TINY_MODEL, "max_position_embeddings": 8}}, "max_position_embeddings=8"),
        ({"backend": "nccl"}, "invalid backend='nccl': no CUDA device"),
    ],
)
def test_check_names_the_field(
    tiny_dataset: Path, tmp_path: Path, values: dict, fragment: str
) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "m", **values)
    if fragment.startswith("invalid backend") and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(ConfigError, match="invalid") as info:
        check(cfg, world_size=2)
    assert fragment in str(info.value)


def test_unknown_strategy_is_refused_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(["--set", "dataset_dir=d", "--set", "output_dir=o", "--set", "strategy=zero3"])
    assert "invalid strategy='zero3'" in str(info.value)
    assert "'ddp', 'fsdp'" in str(info.value)


def test_pretrained_model_problems_are_config_errors(
    tiny_dataset: Path, hf_model: Path, tmp_path: Path
) -> None:
    short = tiny_config(tiny_dataset, tmp_path / "m", model_name_or_path=str(hf_model))
    base = json.loads((hf_model / "config.json").read_text())
    remote = tmp_path / "remote-code"
    remote.mkdir()
    config = {
        **base,
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"},
        "model_type": "evil",
    }
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"invalid model_name_or_path=.*remote-code"):
        check(short.model_copy(update={"model_name_or_path": str(remote)}), world_size=1)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((hf_model / "config.json").read_text())
    torch.save(load_file(hf_model / "model.safetensors"), pickled / "pytorch_model.bin")
    # refused before any process group starts: pickled weights are never loaded
    with pytest.raises(ConfigError, match=r"pickled.*no safetensors.*pytorch_model.bin"):
        check(short.model_copy(update={"model_name_or_path": str(pickled)}), world_size=1)

    small = tmp_path / "small-vocab"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**base, "vocab_size": 10}))
    with pytest.raises(ConfigError, match="vocab_size is 10"):
        check(short.model_copy(update={"model_name_or_path": str(small)}), world_size=1)


def test_lora_target_that_does_not_exist_is_a_config_error(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "m", lora={"target_modules": ["nope_proj"]})
    plan = check(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"invalid lora.target_modules=\['nope_proj'\]"):
        build_model(cfg, plan.tokenizer)
