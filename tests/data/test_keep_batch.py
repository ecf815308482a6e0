"""`_Cleaner.keep_batch` (a batch of plain-text JSONL records, per-batch work where it can)
gives exactly what `_Cleaner.keep` gives one record at a time: the same kept texts, splits,
counts by reason, fingerprint and errors, on text built to hit every branch of normalize
and every filter (whitespace at the edges and in runs, each control character, NFD and
non-Latin-1 text, empty, long, symbol-heavy and repeated-line text, duplicates)."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from kubellm.data.prepare import DataError, PrepareParams, _Cleaner
from kubellm.data.records import Counts, Record, TextBatch

PIECES = [
    "word", "the", "x", "42", " ", "  ", "\t", "\r", "\f", "\v", "\n", "\n\n", " \n", "\n ",
    "\x1c", "\x1f", "\x85", "\xa0", "\u3000", "\u2028", "é", "e\u0301", "Å", "東京", "😀",
    "ﬁ", "!!", "{}", "#", "<b>", "same line", "\nsame line",
]  # fmt: skip


def _text(rng: random.Random) -> str:
    if rng.random() < 0.2:  # lines, some repeated, some blank: the repeated-lines filter
        lines = [rng.choice(["one line", "two", " two", "", "three\t"]) for _ in range(8)]
        return "\n".join(lines[: rng.randint(1, 8)])
    return "".join(rng.choice(PIECES) for _ in range(rng.choice([0, 1, 2, 5, 20, 60])))


def _batch(texts: list[str], first: int = 3) -> TextBatch:
    return TextBatch(
        texts, pa.array(texts, pa.string()), "f.jsonl", range(first, first + len(texts))
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("near_dedup", [False, True])
def test_keep_batch_is_keep_record_by_record(seed: int, near_dedup: bool) -> None:
    rng = random.Random(seed)
    texts = [_text(rng) for _ in range(3000)]
    texts += rng.sample(texts, 300)  # exact duplicates
    rng.shuffle(texts)
    p = PrepareParams(max_chars=150, min_chars=3, near_dedup=near_dedup, val_fraction=0.3)
    one, many = Counts(), Counts()
    ref, cleaner = _Cleaner(p, one), _Cleaner(p, many)
    expected, got = [], []
    for i, t in enumerate(texts):
        one.read += 1
        kept = ref.keep(Record(t, f"f.jsonl:{3 + i}"))
        if kept is not None:
            expected.append((kept[0].text, kept[1]))
    for start in range(0, len(texts), 700):  # batches of several sizes, in order
        chunk = texts[start : start + 700]
        many.read += len(chunk)
        got += zip(*cleaner.keep_batch(_batch(chunk, 3 + start)), strict=True)
    assert got == expected
    assert (many.kept, many.dropped) == (one.kept, one.dropped)
    assert set(one.dropped) >= {
        "empty",
        "too_long",
        "too_short",
        "symbol_ratio",
        "repeated_lines",
        "duplicate",
    }
    assert cleaner.fingerprint.hexdigest() == ref.fingerprint.hexdigest()


def test_keep_batch_fails_strict_mode_on_the_same_record() -> None:
    p = PrepareParams(max_chars=10, on_error="fail")
    texts = ["ok text", "too  long\tby far", "   "]
    with pytest.raises(DataError) as batch_err:
        _Cleaner(p, Counts()).keep_batch(_batch(texts))
    with pytest.raises(DataError) as one_err:
        cleaner = _Cleaner(p, Counts())
        for i, t in enumerate(texts):
            cleaner.keep(Record(t, f"f.jsonl:{3 + i}"))
    assert (
        str(batch_err.value)
        == str(one_err.value)
        == ("f.jsonl:4: too long: 15 characters > max_chars=10")
    )
