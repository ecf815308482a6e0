"""The model side of training: build it, wrap it for data parallelism, export it.

- `new_llama`: the from-config model, a small Llama-style causal LM shaped by ModelConfig
  (the local default);
- `build_model`: what a TrainConfig asks for, on CPU in float32, identical on every rank: a
  Hugging Face directory or hub name (safetensors only, no remote code unless asked) or
  `new_llama`, then LoRA (PEFT), activation checkpointing, per-layer `torch.compile`;
- `wrap`: DDP, or FSDP2 `fully_shard` per decoder layer and the root;
- `export`: the Hugging Face directory every later stage loads, written atomically.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from kubellm.config import ConfigError, ModelConfig, TrainConfig


def new_llama(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """A randomly initialised Llama whose vocabulary and special tokens match `tokenizer`."""
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def hf_config(cfg: TrainConfig) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code
        )
    except Exception as err:  # OSError, ValueError: say which field and why, in one line
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"invalid model_name_or_path={cfg.model_name_or_path!r}: {reason}"
        ) from None


def _base_model(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, by the Hugging Face `_no_split_modules` convention."""
    names = set(getattr(_base_model(model), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def build_model(cfg: TrainConfig, tokenizer: Any, weights: bool = True) -> torch.nn.Module:
    """The model to train, on CPU, in float32, identical on every rank (seeded).

    `weights=False` skips reading a pretrained model's weights: the same modules, to be
    filled with `load_state_dict` (the FSDP export's rank-0 copy).
    """
    torch.manual_seed(cfg.seed)
    model: Any
    if cfg.model_name_or_path and not weights:
        from transformers import AutoModelForCausalLM

        hf = hf_config(cfg)
        model = AutoModelForCausalLM.from_config(
            hf, trust_remote_code=cfg.trust_remote_code, dtype=torch.float32
        )
    elif cfg.model_name_or_path:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(
                cfg.model_name_or_path,
                trust_remote_code=cfg.trust_remote_code,
                use_safetensors=True,  # never unpickle weights
                dtype=torch.float32,
            )
        except (OSError, ValueError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise ConfigError(
                f"invalid model_name_or_path={cfg.model_name_or_path!r}: {reason}"
            ) from None
    else:
        model = new_llama(cfg.model, tokenizer)
    # Training never reuses keys and values: without this every layer also builds a K/V
    # cache each forward (and recompiles per layer under `compile`). export() turns it on.
    model.config.use_cache = False
    if cfg.activation_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        try:
            model = get_peft_model(
                model,
                LoraConfig(
                    r=cfg.lora.r,
                    lora_alpha=cfg.lora.alpha,
                    lora_dropout=cfg.lora.dropout,
                    target_modules=cfg.lora.target_modules,
                    task_type="CAUSAL_LM",
                ),
            )
        except ValueError as err:
            raise ConfigError(
                f"invalid lora.target_modules={cfg.lora.target_modules}: {err}"
            ) from None
    if cfg.compile:
        for layer in decoder_layers(model):
            layer.compile()  # in place: parameter names (and checkpoints) stay the same
    return model


def wrap(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device, bf16: bool, world: int
) -> torch.nn.Module:
    """DDP or FSDP2 around the model (after the process group exists); as is for one process."""
    model.to(device)
    if world == 1:
        return model
    if cfg.strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        # The model's buffers (rotary frequencies) are constants: no broadcast each forward.
        return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def export(model: torch.nn.Module, tokenizer: Any, output_dir: str) -> None:
    """Write the Hugging Face directory atomically: a temp name, then rename."""
    out = Path(output_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per shard: noise in a job log
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.eos_token_id = tokenizer.eos_token_id
        gen.pad_token_id = tokenizer.pad_token_id
        gen.do_sample = False
    model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
