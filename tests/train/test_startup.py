"""Large-model start-up (kubellm.train.startup): a skeleton on `meta`, sharded before it is
real, the pretrained weights read once by rank 0 and streamed; and FSDP2 gradient
accumulation that keeps gradients sharded.

The defects these catch: every rank running `from_pretrained` in fp32 on CPU (one full copy
per rank, one read of the volume per rank), `model.to(device)` before `fully_shard` (the
whole model on every GPU), and accumulation under `set_requires_gradient_sync(False)` (full
unsharded fp32 gradients on every rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from startup_worker import accumulation, sharded_start
from trainkit import save_llama, tiny_config
from transformers import LlamaForCausalLM

from kubellm.config import ConfigError
from kubellm.train import startup
from kubellm.train.loop import check
from kubellm.train.model import build_model, place


@pytest.fixture(scope="module")
def tied_model(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 'pretrained' Llama with tied embeddings (as Llama-3.2-1B, Qwen2.5-0.5B), saved with
    save_pretrained in two safetensors shards (an index file, as large models are)."""
    out = tmp_path_factory.mktemp("pretrained") / "tied-llama"
    save_llama(tiny_dataset, out, seed=3, tie=True, layers=3, heads=4, max_shard_size="40KB")
    assert (out / startup.INDEX).is_file()
    return out


def _saved(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in startup.weight_files(model_dir):
        out.update(load_file(f))
    return out


def test_a_pretrained_model_is_built_on_meta_and_filled_once(
    tiny_dataset: Path, tied_model: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "m", model_name_or_path=str(tied_model))
    plan = check(cfg, world_size=1)
    model = build_model(cfg, plan.tokenizer)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated, nothing read
    assert all(not b.is_meta for b in model.buffers())  # rotary frequencies are real
    place(model, cfg, torch.device("cpu"), False, distributed=False)
    saved = _saved(tied_model)
    state = model.state_dict()
    assert "lm_head.weight" not in saved  # tied: the file carries the embedding only
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # the same model from_pretrained gives the same logits (buffers and ties are right)
    ref = LlamaForCausalLM.from_pretrained(tied_model, dtype=torch.float32)
    x = torch.tensor([[1, 5, 9, 2]])
    assert torch.allclose(model(input_ids=x).logits, ref(input_ids=x).logits, atol=1e-6)


def test_lora_adapters_on_a_meta_skeleton_are_real_and_seeded(
    tiny_dataset: Path, tied_model: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(
        tiny_dataset,
        tmp_path / "m",
        model_name_or_path=str(tied_model),
        lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
    )
    plan = check(cfg, world_size=1)
    a, b = build_model(cfg, plan.tokenizer), build_model(cfg, plan.tokenizer)
    lora = {n: p for n, p in a.named_parameters() if ".lora_" in n}
    assert lora and all(not p.is_meta for p in lora.values())
    assert all(p.is_meta for n, p in a.named_parameters() if ".lora_" not in n)
    other = dict(b.named_parameters())
    assert all(torch.equal(p, other[n]) for n, p in lora.items())  # same on every rank
    assert any(p.abs().sum() > 0 for n, p in lora.items() if "lora_A" in n)
    assert all(p.abs().sum() == 0 for n, p in lora.items() if "lora_B" in n)
    place(a, cfg, torch.device("cpu"), False, distributed=False)
    after = dict(a.named_parameters())
    assert all(torch.equal(after[n], other[n]) for n in lora)  # kept through materialize
    q = after["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert torch.equal(q, _saved(tied_model)["model.layers.0.self_attn.q_proj.weight"])


def test_missing_weights_name_the_parameter(
    tiny_dataset: Path, tied_model: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tied_model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    index = json.loads((broken / startup.INDEX).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != last}
    (broken / startup.INDEX).write_text(json.dumps(index))
    cfg = tiny_config(tiny_dataset, tmp_path / "m", model_name_or_path=str(broken))
    model = build_model(cfg, check(cfg, world_size=1).tokenizer)
    with pytest.raises(ConfigError, match=r"no weights for \d+ parameter\(s\), e.g. model\."):
        place(model, cfg, torch.device("cpu"), False, distributed=False)


def _spawn(target, cfg_json: str, tmp_path: Path) -> list[dict]:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(target, args=(2, str(tmp_path / "store"), cfg_json, str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_fsdp_start_up_reads_on_rank_0_only_and_each_rank_holds_its_shard(
    tiny_dataset: Path, tied_model: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(
        tiny_dataset,
        tmp_path / "m",
        model_name_or_path=str(tied_model),
        strategy="fsdp",
        backend="gloo",
        precision="fp32",
    )
    ranks = _spawn(sharded_start, cfg.model_dump_json(), tmp_path)
    saved = _saved(tied_model)
    assert ranks[0]["reads"] == len(saved)  # every tensor read once, by rank 0
    assert ranks[1]["reads"] == 0  # the other ranks never touch the files
    for r in ranks:
        assert r["dtensor"] and not r["meta_left"]
        assert r["local"] <= r["total"] / 2 + 64  # its shard, never the whole model
        assert r["fused"]  # fused AdamW on FSDP2's DTensor parameters
    assert ranks[0]["local"] + ranks[1]["local"] == ranks[0]["total"]
    full = torch.load(tmp_path / "out" / "full.pt", weights_only=True)
    for name, tensor in saved.items():
        assert torch.equal(full[name], tensor), name


def test_fsdp_accumulation_keeps_gradients_sharded(tiny_dataset: Path, tmp_path: Path) -> None:
    cfg = tiny_config(
        tiny_dataset,
        tmp_path / "m",
        strategy="fsdp",
        backend="gloo",
        precision="fp32",
        grad_accum_steps=2,
    )
    for r in _spawn(accumulation, cfg.model_dump_json(), tmp_path):
        # after the first of two micro-batches: this rank's shard of every gradient, and no
        # unsharded accumulation buffer (which would be a full fp32 copy per rank)
        assert r["full"] == 0, r
        assert 0 < r["sharded"] <= r["shard_max"], r
