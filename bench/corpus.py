"""A deterministic, English-like JSONL corpus for the prepare_data benchmark.

Documents are paragraphs of sentences drawn from a seeded, Zipf-weighted vocabulary (real
function words at the head, pronounceable made-up words in the tail, a few numbers and
accented words), 300 to about 3000 characters each. About 2 % of the records repeat an
earlier document exactly and about 0.25 % are bad lines (malformed JSON, invalid UTF-8,
a missing or non-string text field, an empty text), so prepare's cleaning and dedup paths
do real work.

Every corpus is written streaming (never held in memory) next to a companion file holding
exactly the documents a correct prepare keeps (valid, non-empty, first occurrence), one
JSON object a line: the input of the `datasets` peer (whose JSON reader stops at the first
malformed line) and the texts of the encode_batch floor. Both are cached under the cache
directory, keyed by size, seed and generator version; the text is already normalized
(NFC, single spaces, stripped lines), so prepare's normalization leaves it unchanged.

    python -m bench.corpus --size-mb 20 --seed 0 [--cache-dir runs/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

GENERATOR_VERSION = 1
MIB = 1 << 20

# The head of the distribution: real English function and common words, most frequent first.
_COMMON = [
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "been",
    "has",
    "would",
    "when",
    "who",
    "will",
    "more",
    "if",
    "no",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
]
_ACCENTED = ["café", "naïve", "résumé", "façade", "coöperate", "déjà", "señor", "über"]
_ONSETS = ["b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr"]
_ONSETS += ["pl", "gr", "ch", "th", "sh", "br", "cl", "pr", "sp", ""]
_VOWELS = ["a", "e", "i", "o", "u", "ea", "ou", "io", "ai", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rt", "ck", "x"]


@dataclass(frozen=True)
class Corpus:
    """A generated corpus: the raw JSONL and the companion file of the documents kept."""

    path: Path  # every record, duplicates and bad lines included
    kept_path: Path  # {"text": ...} per document a correct prepare keeps, in input order
    size_bytes: int
    records: int  # lines written (read = kept + dropped)
    kept: int
    duplicates: int
    bad: int  # malformed/invalid/missing/empty lines


def _vocabulary(rng: random.Random, size: int) -> tuple[list[str], list[float]]:
    """Words and cumulative Zipf weights (rank r has weight 1 / (r + 2.7))."""
    words: list[str] = list(_COMMON)
    seen = set(words)
    while len(words) < size:
        n = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n))
        w += rng.choice(_CODAS)
        if len(w) > 1 and w not in seen:
            seen.add(w)
            words.append(w)
    cum: list[float] = []
    total = 0.0
    for rank in range(len(words)):
        total += 1.0 / (rank + 2.7)
        cum.append(total)
    return words, cum


class _DocGen:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.words, self.cum = _vocabulary(random.Random(seed * 7919 + 1), 30_000)

    def sentence(self) -> str:
        rng = self.rng
        n = rng.randint(4, 24)
        ws = rng.choices(self.words, cum_weights=self.cum, k=n)
        r = rng.random()
        if r < 0.08:  # a number somewhere
            ws[rng.randrange(n)] = str(rng.choice((rng.randint(2, 99), rng.randint(1800, 2030))))
        elif r < 0.10:
            ws[rng.randrange(n)] = rng.choice(_ACCENTED)
        if n > 8 and rng.random() < 0.4:
            i = rng.randrange(2, n - 2)
            ws[i] += ","
        ws[0] = ws[0][:1].upper() + ws[0][1:]
        return " ".join(ws) + rng.choice(".........?!")

    def document(self) -> str:
        rng = self.rng
        # log-uniform target length; the last sentence overshoots by a little
        target = int(300 * (2800 / 300) ** rng.random())
        paras: list[str] = []
        length = 0
        while length < target:
            sents = []
            for _ in range(rng.randint(2, 7)):
                s = self.sentence()
                sents.append(s)
                length += len(s) + 1
                if length >= target:
                    break
            paras.append(" ".join(sents))
            length += 1
        doc = "\n\n".join(paras)
        while len(doc) < 300:  # the floor of the length range, exactly
            doc += " " + self.sentence()
        return doc


def _bad_line(rng: random.Random, i: int, text: str) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:  # malformed JSON: a truncated line
        return json.dumps({"id": i, "text": text}).encode()[: rng.randint(5, 60)] + b"\n"
    if kind == 1:  # invalid UTF-8 inside an otherwise fine line
        return b'{"id": %d, "text": "caf\xe9 au lait, broken bytes"}\n' % i
    if kind == 2:  # no text field
        return json.dumps({"id": i, "body": text[:80]}).encode() + b"\n"
    if kind == 3:  # non-string text
        return json.dumps({"id": i, "text": None}).encode() + b"\n"
    return json.dumps({"id": i, "text": "   "}).encode() + b"\n"  # empty after normalization


def generate(
    path: Path, kept_path: Path, size_bytes: int, seed: int = 0, dup_rate: float = 0.02
) -> Corpus:
    """Write about `size_bytes` (at least that many) of JSONL to `path`, streaming."""
    gen = _DocGen(seed)
    side = random.Random(seed * 104_729 + 3)  # duplicates and bad lines: an independent stream
    recent: list[str] = []
    written = records = kept = dups = bad = 0
    with open(path, "wb") as out, open(kept_path, "wb") as kept_out:
        while written < size_bytes:
            r = side.random()
            if r < 0.0025:
                line = _bad_line(side, records, gen.document())
                bad += 1
            elif r < 0.0025 + dup_rate and recent:
                text = side.choice(recent)
                line = json.dumps(
                    {"id": records, "text": text, "source": "bench"}, ensure_ascii=False
                ).encode()
                line += b"\n"
                dups += 1
            else:
                text = gen.document()
                line = json.dumps(
                    {"id": records, "text": text, "source": "bench"}, ensure_ascii=False
                ).encode()
                line += b"\n"
                kept_out.write(json.dumps({"text": text}, ensure_ascii=False).encode() + b"\n")
                kept += 1
                if len(recent) < 512:
                    recent.append(text)
                else:
                    recent[side.randrange(512)] = text
            out.write(line)
            written += len(line)
            records += 1
    return Corpus(path, kept_path, written, records, kept, dups, bad)


def ensure_corpus(cache_dir: str | Path, size_mb: float, seed: int = 0) -> Corpus:
    """The cached corpus of `size_mb` MiB for `seed`, generating it (atomically) if absent."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    stem = f"corpus-{size_mb:g}mib-seed{seed}-v{GENERATOR_VERSION}"
    path, kept_path = cache / f"{stem}.jsonl", cache / f"{stem}.kept.jsonl"
    meta_path = cache / f"{stem}.json"
    if path.is_file() and kept_path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("size_bytes") == path.stat().st_size:
            return Corpus(path, kept_path, **meta)
    tmp, kept_tmp = path.with_suffix(".tmp"), kept_path.with_suffix(".tmp")
    c = generate(tmp, kept_tmp, int(size_mb * MIB), seed)
    os.replace(kept_tmp, kept_path)
    os.replace(tmp, path)
    meta = {k: getattr(c, k) for k in ("size_bytes", "records", "kept", "duplicates", "bad")}
    meta_path.write_text(json.dumps(meta))
    return Corpus(path, kept_path, **meta)


def kept_texts(kept: Corpus | str | Path) -> list[str]:
    """The kept documents' texts, in input order (what prepare tokenizes)."""
    path = kept.kept_path if isinstance(kept, Corpus) else Path(kept)
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=20.0, help="MiB of JSONL")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default="runs/bench")
    args = ap.parse_args(argv)
    c = ensure_corpus(args.cache_dir, args.size_mb, args.seed)
    print(
        f"{c.path}: {c.size_bytes / MIB:.1f} MiB, {c.records} records, {c.kept} kept, "
        f"{c.duplicates} duplicates, {c.bad} bad lines"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
