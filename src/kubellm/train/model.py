"""The model side of training: build it, wrap it for data parallelism, export it.

- `new_llama`: the from-config model, a small Llama-style causal LM shaped by ModelConfig
  (the local default);
- `build_model`: what a TrainConfig asks for: a Hugging Face directory or hub name (a
  skeleton on `meta`; safetensors only, no remote code unless asked) or `new_llama` (real,
  float32, seeded), then LoRA (PEFT), activation checkpointing, per-layer `torch.compile`;
- `place`: DDP, or FSDP2 / HSDP `fully_shard` per decoder layer and the root, then storage
  on the device and the pretrained weights (kubellm.train.startup: rank 0 reads them once);
- `export`: the Hugging Face directory every later stage loads, written atomically.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from kubellm.config import ConfigError, ModelConfig, TrainConfig
from kubellm.train import startup


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


def is_pretrained(cfg: TrainConfig) -> bool:
    return bool(cfg.model_name_or_path)


def build_model(cfg: TrainConfig, tokenizer: Any, *, meta: bool | None = None) -> torch.nn.Module:
    """The model to train, its modules complete (LoRA, activation checkpointing, compile).

    A pretrained model is a skeleton: its parameters on the `meta` device (no memory, no
    reads), filled after sharding by `place` (rank 0 reads the weights once). A from-config
    model is real, on CPU, float32, seeded (identical on every rank) unless `meta` is asked
    (the export's skeleton).
    """
    torch.manual_seed(cfg.seed)
    if meta is None:
        meta = is_pretrained(cfg)
    model: Any
    with startup.meta_parameters() if meta else contextlib.nullcontext():
        if is_pretrained(cfg):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(
                hf_config(cfg), trust_remote_code=cfg.trust_remote_code, dtype=torch.float32
            )
        else:
            model = new_llama(cfg.model, tokenizer)
    # Training never reuses keys and values: without this every layer also builds a K/V
    # cache each forward (and recompiles per layer under `compile`). export() turns it on.
    model.config.use_cache = False
    if cfg.activation_checkpointing:
        activation_checkpointing(model, True)
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
        if meta:
            startup.init_adapters(model, cfg.seed)  # real before sharding, same on every rank
    if cfg.compile:
        for layer in decoder_layers(model):
            layer.compile()  # in place: parameter names (and checkpoints) stay the same
    return model


def tie_weights(model: torch.nn.Module) -> None:
    """Re-tie lm_head to the input embedding where the config ties them (a state dict
    loaded with `assign=True` gives each its own tensor)."""
    base = _base_model(model)
    if getattr(base.config, "tie_word_embeddings", False):
        base.tie_weights()


def _is_meta(model: torch.nn.Module) -> bool:
    return any(startup._local(p).is_meta for p in model.parameters())


def place(
    model: torch.nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    bf16: bool,
    *,
    distributed: bool,
    rank: int = 0,
    local_world: int = 1,
) -> torch.nn.Module:
    """Shard or replicate the model over the process group, give it storage on `device`,
    and load the pretrained weights; returns what the loop calls (DDP's wrapper, or the
    model itself: FSDP2 shards it in place).

    FSDP2 / HSDP: `fully_shard` per decoder layer and the root while the parameters are
    still on `meta` (a real from-config model is moved layer by layer), so no rank ever
    holds the whole model on the device. DDP and one process: the full model on `device`.
    """
    sharded = distributed and cfg.strategy in ("fsdp", "hsdp")
    if sharded:
        _fully_shard(model, cfg, device, bf16, local_world)
    elif not _is_meta(model):
        model.to(device)
    if _is_meta(model):
        startup.materialize(model, device)
        tie_weights(model)  # `to_empty` gives each use of a tied weight its own tensor
        if is_pretrained(cfg):
            report = startup.load_pretrained(
                model, startup.resolve(cfg.model_name_or_path), rank=rank
            )
            if rank == 0:
                unused = f", {len(report.unused)} unused" if report.unused else ""
                print(
                    f"train: loaded {report.loaded} tensors ({report.bytes / 2**30:.2f} GiB) "
                    f"from {cfg.model_name_or_path} on rank 0{unused}",
                    flush=True,
                )
    if distributed and cfg.strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **_constant_buffers())
    return model


@functools.cache
def _constant_buffers() -> dict[str, Any]:
    """DDP's keyword for "the buffers are constants: no broadcast before each forward".

    The model's buffers (rotary frequencies) are computed in `__init__`, the same on every
    rank, and no step changes them. torch 2.13 added `forward_sync_buffers` and deprecated
    `broadcast_buffers` (a FutureWarning); older torch has only `broadcast_buffers`, which
    also skips the buffers' broadcast at construction (`forward_sync_buffers=False` keeps
    it): nothing to copy here, the buffers are already equal.
    """
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def activation_checkpointing(model: Any, on: bool) -> None:
    """Turn activation checkpointing on (non-reentrant) or off. transformers' newer
    `activation_checkpointing_enable` where it has it, else `gradient_checkpointing_enable`,
    the older name of the same switch (the GPU image's transformers may predate the new)."""
    verb = "enable" if on else "disable"
    switch = getattr(model, f"activation_checkpointing_{verb}", None)
    if switch is None:
        switch = getattr(model, f"gradient_checkpointing_{verb}")
    if on:
        switch({"use_reentrant": False})
    else:
        switch()


def _fully_shard(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device, bf16: bool, local_world: int
) -> None:
    """FSDP2 over all ranks, or HSDP: shard within a node, replicate across nodes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    if cfg.strategy == "hsdp":
        mesh = init_device_mesh(
            device.type, (world // local_world, local_world), mesh_dim_names=("replicate", "shard")
        )
        if dist.get_rank() == 0:
            print(
                f"train: hsdp mesh replicate={world // local_world} x shard={local_world}",
                flush=True,
            )
    else:
        mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


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
