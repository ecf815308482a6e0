"""Tokenizers: a byte-level BPE trained on the data (the local default), or a model's own.

Digits are split one per token (as Llama and GPT-NeoX tokenizers do) so numbers keep a
stable, learnable shape instead of arbitrary merges.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kubellm.data.templates import DEFAULT_CHAT_TEMPLATE

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with EOS/PAD specials and wrap it as a transformers tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD, padding_side="left"
    )
    # the format prepare renders chat records in (kubellm.data.templates), saved with the
    # tokenizer: the server renders /chat/completions prompts exactly as training did
    wrapped.chat_template = DEFAULT_CHAT_TEMPLATE
    return wrapped


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer directory (or hub name); remote code only when asked.

    A directory saved as the generic fast tokenizer (what `train_bpe` makes) is loaded by
    that class directly: AutoTokenizer would load the same class, but imports the model
    configuration machinery, and with it torch, first (about 2 s of `kubellm prepare`).
    """
    if _generic_fast(Path(path)):
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        return tok  # type: ignore[no-any-return]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok  # type: ignore[no-any-return,return-value]


_GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _generic_fast(path: Path) -> bool:
    """Whether `path` is a local tokenizer directory of the generic fast class, no remote code."""
    import json

    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(cfg, dict)
        and cfg.get("tokenizer_class") in _GENERIC_FAST
        and "auto_map" not in cfg
        and (path / "tokenizer.json").is_file()
    )
