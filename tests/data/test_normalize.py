"""normalize's fast paths give exactly what the plain definition gives, on messy input.

`_reference` is normalize as first written (NFC, then split into lines, fold each line's
whitespace runs with a regex, strip); prepare's normalize takes shortcuts (no regex, NFC
line by line and only on lines that need it) that must never change a result: the record
kept, its dedup key and its split all hang on the normalized text.
"""

from __future__ import annotations

import random
import re
import sys
import unicodedata

import pytest

from bench.corpus import _MessyGen
from kubellm.data.prepare import normalize, repeated_line_ratio

_WS = re.compile(r"[ \t\r\f\v]+")


def _reference(text: str) -> str:
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if not any(s in text for s in ("  ", "\t", "\r", "\f", "\v", " \n", "\n ")):
        return text.strip()
    if "\n" not in text:
        return _WS.sub(" ", text).strip()
    return "\n".join(_WS.sub(" ", line).strip() for line in text.splitlines()).strip()


def _reference_repeated(text: str) -> float:
    lines = [ln for ln in text.split("\n") if ln]
    if len(lines) < 2:
        return 0.0
    return 1.0 - len(set(lines)) / len(lines)


# Every kind of whitespace and line break Python knows, combining marks, characters NFC
# changes (NFD sequences, singletons like the Angstrom and Kelvin signs, EN QUAD), Hangul
# jamo that compose, control characters, and plain letters.
_PIECES = [
    *" \t\n\r\v\f\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2001\u200a\u2028\u2029\u202f\u205f\u3000",
    *"\u0301\u0327\u0308\u0323\u0307\u212b\u212a\u2126\u1100\u1161\u11a8\uac00\u0344\u0f73",
    *"\x00\x07\x08\x1b\x7f",
    "\r\n",
    "  ",
    "\t\t ",
    "e\u0301",
    "\u00e9",
    "word",
    "a b",
    "\u1e9b\u0323",
    "\ud55c\uad6d",
    "\U0001f642",
    "x",
    "y",
]


def _random_text(rng: random.Random) -> str:
    weights = [rng.random() ** 2 for _ in _PIECES]
    return "".join(rng.choices(_PIECES, weights, k=rng.randint(0, 60)))


@pytest.mark.parametrize("seed", range(4))
def test_normalize_equals_the_reference_on_random_messy_text(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(25_000):
        text = _random_text(rng)
        assert normalize(text) == _reference(text), repr(text)


def test_normalize_equals_the_reference_on_messy_documents() -> None:
    """The benchmark's messy documents: long, indented, CRLF, NFD, control characters."""
    gen = _MessyGen(seed=3)
    for i in range(60):
        single = i % 7 == 0  # one long line, as the generator makes some documents
        lines = gen._wrapped(0, 20) if single else gen.document(2000 + 300 * i)
        raw = gen.render(lines, single)
        assert normalize(raw) == _reference(raw) == gen.canonical(lines, single)
        assert repeated_line_ratio(raw) == _reference_repeated(raw)
        norm = normalize(raw)
        assert repeated_line_ratio(norm) == _reference_repeated(norm)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "\u3000\xa0",
        "only\rcarriage\rreturns",  # no LF: CR folds as a space
        "a\x1cb  c",  # with folding, every line break splitlines knows splits
        "a\x1cb c",  # without, the text is only stripped
        "a \u2028 b\n",
        "e\u0301\u0301 \n\u212b  \t",
        "\t\tindented\r\n\t\tcode  \r\n\f\r\nnext",
        "x" + " \xa0" * 5000 + "\ny" + " " * 10_000 + "z",  # long runs: no quadratic path
        "\u1100\u1161\n\u11a8",  # jamo across a line break do not compose
    ],
)
def test_normalize_edge_cases(text: str) -> None:
    assert normalize(text) == _reference(text)


def test_text_below_u0100_is_nfc() -> None:
    """normalize skips NFC for Latin-1 text: no character or pair there changes under NFC."""
    latin1 = [chr(c) for c in range(256)]
    assert all(unicodedata.is_normalized("NFC", a + b) for a in latin1 for b in latin1)


_BREAKS_AND_SPACE = {chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()}


def test_nfc_never_touches_whitespace_or_line_breaks() -> None:
    """Why NFC can be applied line by line, after stripping and folding, with the same result.

    Over every code point: NFC maps whitespace to whitespace and anything else to no
    whitespace (so it neither creates nor removes what strip, fold and splitlines act on);
    whitespace has combining class 0 (canonical reordering never moves a mark across it);
    and no canonical composition has whitespace in it (nothing merges across a line break or
    a space; the only decompositions that hold whitespace are singletons such as EN QUAD ->
    EN SPACE, whitespace to whitespace).
    """
    assert {"\n", "\r", "\x1c", "\x85", "\u2028", "\u2029"} <= _BREAKS_AND_SPACE
    for c in range(sys.maxunicode + 1):
        if 0xD800 <= c <= 0xDFFF:
            continue
        ch = chr(c)
        nfc = unicodedata.normalize("NFC", ch)
        space = ch in _BREAKS_AND_SPACE
        assert all((x in _BREAKS_AND_SPACE) == space for x in nfc), hex(c)
        if space:
            assert unicodedata.combining(ch) == 0, hex(c)
        decomposition = unicodedata.decomposition(ch).split()
        if len(decomposition) > 1 and not decomposition[0].startswith("<"):  # a composition
            assert not any(chr(int(h, 16)) in _BREAKS_AND_SPACE for h in decomposition), hex(c)
