"""The from-config model: a tiny Llama-style causal LM, shaped by ModelConfig."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from kubellm.config import ModelConfig


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
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
