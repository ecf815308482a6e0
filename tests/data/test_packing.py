"""Packing strategies: exact token accounting, whole documents where they fit."""

from __future__ import annotations

import numpy as np
import pytest

from kubellm.data.packing import BestFitPacker, ConcatPacker, is_masked, make_packer

EOS, PAD = 0, 1


def _docs(lengths: list[int], start: int = 10) -> list[tuple[list[int], int]]:
    out, tok = [], start
    for n in lengths:
        out.append((list(range(tok, tok + n)), 0))
        tok += n
    return out


def test_concat_chunks_with_eos_and_crops_only_the_tail() -> None:
    packer = ConcatPacker(seq_len=4, eos=EOS)
    rows = packer.add(_docs([3, 2, 4]))  # 4 + 3 + 5 = 12 tokens with EOS -> 3 rows
    assert rows.ids.tolist() == [[10, 11, 12, 0], [13, 14, 0, 15], [16, 17, 18, 0]]
    assert packer.add(_docs([1], start=50)).ids.shape == (0, 4)  # 2 tokens wait for more
    packer.finish()
    assert (packer.stats.tokens, packer.stats.cropped, packer.stats.padding) == (14, 2, 0)


def test_concat_keeps_the_prompt_mask_across_row_boundaries() -> None:
    packer = ConcatPacker(seq_len=3, eos=EOS)
    rows = packer.add([([5, 6, 7, 8], 3), ([9], 0)])  # prompt 5,6,7; target 8, EOS, 9, EOS
    assert rows.ids.tolist() == [[5, 6, 7], [8, 0, 9]]
    assert rows.mask.tolist() == [[0, 0, 0], [1, 1, 1]]


def test_best_fit_keeps_documents_whole_and_pads() -> None:
    packer = BestFitPacker(seq_len=8, eos=EOS, pad=PAD, window=1)
    rows = packer.add(_docs([5, 3, 2, 1]))  # with EOS: 6, 4, 3, 2 -> rows [6+2], [4+3]
    assert len(rows) == 2
    as_rows = rows.ids.tolist()
    for ids, _ in _docs([5, 3, 2, 1]):  # each document sits whole, in order, in one row
        [row] = [r for r in as_rows if ids[0] in r]
        start = row.index(ids[0])
        assert row[start : start + len(ids) + 1] == [*ids, EOS]
    for row, mask in zip(as_rows, rows.mask.tolist(), strict=True):
        assert mask.count(0) == row.count(PAD)
    assert packer.stats.padding == 16 - 15 and packer.stats.cropped == 0
    flat = [t for row in rows.ids.tolist() for t in row if t not in (EOS, PAD)]
    assert sorted(flat) == list(range(10, 21))  # every document token exactly once


def test_best_fit_splits_documents_longer_than_a_row() -> None:
    packer = BestFitPacker(seq_len=4, eos=EOS, pad=PAD, window=1)
    rows = packer.add(_docs([9]))  # 10 tokens with EOS -> 4 + 4 + 2
    assert len(rows) == 3 and packer.stats.cropped == 0 and packer.stats.padding == 2


def test_best_fit_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=500).tolist()
    a = BestFitPacker(32, EOS, PAD, window=10_000)
    b = BestFitPacker(32, EOS, PAD, window=10_000)
    a.add(_docs(lengths))
    b.add(_docs(lengths))
    ra, rb = a.finish(), b.finish()
    assert np.array_equal(ra.ids, rb.ids)
    assert a.stats.padding / (len(ra) * 32) < 0.1  # best fit wastes little


def test_unknown_strategy_is_named() -> None:
    with pytest.raises(ValueError, match="packing='greedy'"):
        make_packer("greedy", 8, EOS, PAD)


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_a_per_token_mask_trains_several_spans_and_the_eos(strategy: str) -> None:
    """A chat with two trained assistant turns: its mask is per token (prepare's `_docs`),
    and both packers write it as given, with the EOS after the document trained."""
    chat = ([5, 6, 7, 8, 9, 10], np.array([0, 1, 1, 0, 0, 1], dtype=np.int8))
    plain = ([11, 12], 1)  # n_prompt form, beside it
    seq_len = 10 if strategy == "concat" else 11  # best_fit pads the one free slot
    packer = make_packer(strategy, seq_len, EOS, PAD)
    rows = packer.add([chat, plain])
    if strategy == "best_fit":
        rows = packer.finish()
    ids = [5, 6, 7, 8, 9, 10, EOS, 11, 12, EOS, PAD]
    mask = [0, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0]
    assert rows.ids.tolist() == [ids[:seq_len]]
    assert rows.mask.tolist() == [mask[:seq_len]]
    assert is_masked(chat[1]) and is_masked(1) and not is_masked(0)
    assert not is_masked(np.ones(3, dtype=np.int8))
