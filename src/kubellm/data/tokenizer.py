"""Tokenizers: a byte-level BPE trained on the data (the local default), or a model's own.

Digits are split one per token (as Llama and GPT-NeoX tokenizers do) so numbers keep a
stable, learnable shape instead of arbitrary merges.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
PAD = "<|pad|>"
# A plain "role: content" transcript, so a model trained here answers OpenAI chat requests
# (servers refuse chat for a tokenizer without a template).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


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
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer directory (or hub name); remote code only when asked."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok  # type: ignore[no-any-return,return-value]
