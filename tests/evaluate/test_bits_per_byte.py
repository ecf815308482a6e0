"""kubellm.evaluate.metrics: bits per byte, the held-out loss models of different tokenizers
compare on (each scores its own tokenization of the same texts)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from kubellm.config import ModelConfig
from kubellm.data.artifact import IGNORE_INDEX, load_split, tokenizer_dir
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.data.tokenizer import load_tokenizer
from kubellm.evaluate.metrics import bits_per_byte, heldout_texts
from kubellm.train.model import new_llama


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prompt/answer records of made-up words and sums: a BPE of 400 has merges to learn."""
    root = tmp_path_factory.mktemp("bpb")
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si"]
    lines = []
    for _ in range(300):
        word = "".join(rng.choices(syllables, k=3))
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        prompt = f"{word} {a}+{b}="
        record = {"prompt": prompt, "completion": str(a + b), "text": f"{prompt}{a + b}"}
        lines.append(json.dumps(record))
    (root / "records.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "dataset"
    prepare(PrepareParams(source=str(root / "records.jsonl"), vocab_size=400, seq_len=16), out)
    return out


def _model(tokenizer: object, positions: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64)
    model = new_llama(shape, tokenizer).eval()  # type: ignore[arg-type]
    model.config.max_position_embeddings = positions
    return model


def test_the_texts_are_the_target_tokens_of_each_row(dataset: Path) -> None:
    tok = load_tokenizer(tokenizer_dir(dataset))
    x, y = load_split(str(dataset), "val")
    rows = heldout_texts(dataset)
    assert rows and all(not row[0][1] for row in rows)  # a row starts with context
    special = set(tok.all_special_ids)
    ids, labels = x[0].tolist(), y[0].tolist()
    targets = [
        t
        for i, (t, lab) in enumerate(zip(ids, labels, strict=True))
        if i > 0 and lab != IGNORE_INDEX and t not in special
    ]
    scored = "".join(text for text, s in rows[0] if s)
    assert len(scored.encode()) == len(tok.decode(targets).encode())


def test_with_the_datasets_tokenizer_it_is_the_token_loss_per_byte(dataset: Path) -> None:
    """Scored on its own tokens, a model's bits per byte is its nats on those target tokens
    over ln 2 and their bytes: computed here from the packed ids directly."""
    tok = load_tokenizer(tokenizer_dir(dataset))
    model = _model(tok)
    x, y = load_split(str(dataset), "val")
    special = torch.tensor(sorted(tok.all_special_ids))
    keep = (y != IGNORE_INDEX) & ~torch.isin(x, special)
    keep[:, 0] = False
    labels = x.long().masked_fill(~keep, IGNORE_INDEX)
    with torch.no_grad():
        logits = model(input_ids=x.long()).logits
    nats = float(
        torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum"
        )
    )
    nbytes = sum(
        len(tok.decode([t for t, k in zip(r, m, strict=True) if k]).encode())
        for r, m in zip(x.tolist(), keep.tolist(), strict=True)
    )
    expected = nats / math.log(2) / nbytes
    got = bits_per_byte(model, tok, heldout_texts(dataset))
    # re-encoding decoded pieces may merge a little differently at piece boundaries
    assert got == pytest.approx(expected, rel=0.05)
    # a uniform guess over the vocabulary is log2(V) bits per token: a random model is near
    assert 0.5 * math.log2(len(tok)) < got * nbytes / int(keep.sum()) < 1.5 * math.log2(len(tok))


def test_another_tokenizer_scores_the_same_texts_on_its_own_tokens(
    dataset: Path, tmp_path: Path
) -> None:
    """A character-level tokenizer (vocab far smaller, tokens far more) scores the same texts:
    no index out of range, and the same bytes are counted. Rows longer than its context are
    scored in windows."""
    from kubellm.data.tokenizer import train_bpe

    texts = ["".join(text for text, _ in row) for row in heldout_texts(dataset)]
    small = train_bpe(texts, vocab_size=40)  # the byte alphabet and the specials: no merges
    assert len(small) < len(load_tokenizer(tokenizer_dir(dataset)))
    rows = heldout_texts(dataset)
    longest = max(len(small("".join(t for t, _ in row))["input_ids"]) for row in rows)
    model = _model(small, positions=8)
    assert longest > 8  # windows needed
    windowed = bits_per_byte(model, small, rows)
    whole = bits_per_byte(_model(small), small, rows)
    assert math.isfinite(windowed) and windowed > 0
    assert windowed == pytest.approx(whole, rel=0.2)  # less context, the same text
