"""Deterministic JSONL corpora for the prepare_data benchmark: clean and messy.

The clean corpus (`kind="clean"`):

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

The messy corpus (`kind="messy"`) is real-world-like instead: long documents (about 2 KB to
60 KB, a few over prepare's max_chars) shaped like source-code docstrings and README files:
wrapped prose, indented code blocks, parameter lists, tables, log excerpts with ANSI escapes
and other control characters; mixed Unicode forms (NFC, NFD, canonical singletons such as
U+212B ANGSTROM SIGN, compatibility characters such as ligatures and fullwidth forms that NFC
keeps, CJK, Hangul, emoji); irregular whitespace (tabs, CRLF, runs of spaces, trailing
blanks, no-break and ideographic spaces at line ends, form feeds between sections). Besides
the clean corpus's bad lines and exact duplicates it has documents that prepare's filters
drop (whitespace only, symbol-heavy banners, repeated log lines, too long) and documents
that differ from an earlier one only in whitespace and Unicode form (duplicates once
normalized). Each document is built as its normalized text first and then rendered messy by
changes normalization undoes, so the companion file (the normalized kept texts) and the
expected counts per drop reason come from the generator, not from the code under test.

    python -m bench.corpus --size-mb 20 --seed 0 [--kind clean|messy] [--cache-dir runs/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

GENERATOR_VERSION = 1  # the clean corpus
MESSY_VERSION = 1
SHORT_VERSION = 1
KINDS = ("clean", "messy", "short")
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
    kind: str = "clean"
    # records a correct prepare drops, by reason (the messy corpus; {} where not recorded)
    dropped: dict[str, int] = field(default_factory=dict, compare=False, hash=False)


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
    return _bad_line_of(rng.randrange(5), rng, i, text)


# What prepare counts each kind of _bad_line under.
_BAD_REASONS = ("malformed_json", "invalid_utf8", "missing_text", "missing_text", "empty")


def _bad_line_of(kind: int, rng: random.Random, i: int, text: str) -> bytes:
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


# --- the messy corpus ----------------------------------------------------------------------

# prepare's default filters (PrepareParams), which the benchmark runs with. The messy
# generator applies them itself to the normalized text of each document to know which ones a
# correct prepare keeps (an independent statement of the rules, not a call into kubellm).
MAX_CHARS = 100_000
MAX_SYMBOL_RATIO = 0.5
MAX_REPEATED_LINE_RATIO = 0.5
_SYMBOL = re.compile(r"[\x00-\x08\x0e-\x1f!-/:-@\[-`{-\x7f]")  # ASCII, not alnum or space

# Non-ASCII content, written in NFC (the generator normalizes each document to NFC anyway):
# accented Latin, other scripts, emoji, and compatibility characters that NFC keeps as they
# are (ligatures, circled and fullwidth forms, superscripts, the micro sign, halfwidth kana).
_UNICODE_WORDS = [
    "naïve",
    "crème brûlée",
    "Zürich",
    "São Paulo",
    "Kraków",
    "Ångström",
    "Øresund",
    "Ωmega",
    "Kelvin",
    "Tiếng Việt",
    "Ελληνικά",
    "данные",
    "東京",
    "数据集",
    "한국어",
    "日本語のテキスト",
    "🙂",
    "🚀",
    "ﬁle",
    "①",
    "Ａ１",
    "™",
    "½",
    "x²",
    "5µs",
    "ｶﾀｶﾅ",
    "q\u0307",
    "\u1e9b\u0323",
    "10\u00a0km",
    "中\u3000文",
]
# Canonical singletons: NFC maps each to the character it stands for.
_SINGLETONS = {"Å": "\u212b", "Ω": "\u2126", "K": "\u212a"}
_CONTROL_LINES = [
    "\x1b[32mINFO\x1b[0m {date} worker {n}: {text}",
    "\x1b[1;31mERROR\x1b[0m {date} {text}",
    "progress {n}%\x08\x08\x08 done\x07",
    "key\x00value {text}",
    "{text} \x1b[2K\x7f",
]
_BANNERS = [
    "#" * 72,
    "# " + "=" * 68 + " #",
    "+" + "-" * 30 + "+" + "-" * 30 + "+",
    "/*" + "*" * 66 + "*/",
    "<!-- ====== -->",
    "~" * 40,
    "|:---:|:---:|:---:|",
]
_LOG_SPAM = [
    "WARNING: retrying connection to {host} (attempt {n})",
    "DEBUG heartbeat ok",
    "[{date}] GET /healthz 200",
]


def _symbol_ratio(text: str) -> float:
    return len(_SYMBOL.findall(text)) / max(len(text), 1)


def _repeated_line_ratio(text: str) -> float:
    lines = [ln for ln in text.split("\n") if ln]
    return 0.0 if len(lines) < 2 else 1.0 - len(set(lines)) / len(lines)


def _drop_reason(text: str) -> str | None:
    """Why a correct prepare (default filters) drops this normalized text, if it does."""
    if not text:
        return "empty"
    if len(text) > MAX_CHARS:
        return "too_long"
    if _symbol_ratio(text) > MAX_SYMBOL_RATIO:
        return "symbol_ratio"
    if _repeated_line_ratio(text) > MAX_REPEATED_LINE_RATIO:
        return "repeated_lines"
    return None


# A document before rendering: (indent depth, normalized line) pairs; "" is a blank line.
Lines = list[tuple[int, str]]


class _MessyGen:
    """Normalized documents as lines, and messy renderings of them."""

    def __init__(self, seed: int) -> None:
        self.prose = _DocGen(seed)
        self.rng = self.prose.rng
        self.names = [w for w in self.prose.words[150:3000] if w.isascii() and w.isalpha()]

    # -- content (already normalized: NFC, single spaces, stripped lines) --

    def _sentence(self) -> str:
        s = self.prose.sentence()
        if self.rng.random() < 0.3:
            words = s.split(" ")
            words.insert(self.rng.randrange(len(words)), self.rng.choice(_UNICODE_WORDS))
            s = " ".join(words)
        return s

    def _wrapped(self, depth: int, n_sentences: int) -> Lines:
        width = self.rng.randint(60, 96)
        text = " ".join(self._sentence() for _ in range(n_sentences))
        lines: Lines = []
        line = ""
        for word in text.split(" "):
            if line and len(line) + 1 + len(word) > width:
                lines.append((depth, line))
                line = word
            else:
                line = f"{line} {word}" if line else word
        if line:
            lines.append((depth, line))
        return lines

    def _name(self) -> str:
        return "_".join(self.rng.sample(self.names, self.rng.randint(1, 3)))

    def _code(self) -> Lines:
        rng = self.rng
        name, args = self._name(), ", ".join(self._name() for _ in range(rng.randint(0, 3)))
        lines: Lines = [(0, f"def {name}({args}):")]
        depth = 1
        for _ in range(rng.randint(3, 30)):
            v, w, n = self._name(), self._name(), rng.randint(0, 4096)
            stmt = rng.choice(
                (
                    f"{v} = {w}({n}, key={v!r})",
                    f"if {v} is None or len({v}) > {n}:",
                    f"for {v} in range({n}):",
                    f"return {v}[{n % 7}:]",
                    f"# {self.prose.sentence()}",
                    f'raise ValueError(f"bad {v}: {{{v}!r}}")',
                    f'path = "C:\\\\Users\\\\{v}\\\\data.csv"',
                    f"{v} = {{'{w}': [{n}, {n + 1}], 'ok': True}}",
                )
            )
            lines.append((depth, stmt))
            if stmt.endswith(":"):
                depth = min(depth + 1, 5)
            elif depth > 1 and rng.random() < 0.3:
                depth -= 1
        return lines

    def _params(self) -> Lines:
        rng = self.rng
        head = rng.choice((["Args:"], ["Parameters", "----------"], ["Returns:"]))
        lines: Lines = [(0, h) for h in head]
        for _ in range(rng.randint(1, 6)):
            kind = rng.choice(("int", "str", "list[str] | None", "Path", "dict[str, Any]"))
            lines.append((1, f"{self._name()} ({kind}): {self._sentence()}"))
            if rng.random() < 0.4:
                lines += self._wrapped(2, rng.randint(1, 3))
        return lines

    def _table(self) -> Lines:
        rng = self.rng
        cols = rng.randint(2, 4)
        rule = "+" + "+".join("-" * rng.randint(6, 14) for _ in range(cols)) + "+"
        lines: Lines = [(0, rule)]
        for _ in range(rng.randint(2, 8)):
            cells = " | ".join(
                rng.choice((self._name(), str(rng.randint(0, 10**6)))) for _ in range(cols)
            )
            lines.append((0, f"| {cells} |"))
        return [*lines, (0, rule)]

    def _log(self) -> Lines:
        rng = self.rng
        lines: Lines = []
        for _ in range(rng.randint(2, 12)):
            month, day, hour = rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23)
            date = f"2024-{month:02d}-{day:02d} {hour:02d}:00"
            text = self.prose.sentence()
            lines.append(
                (0, rng.choice(_CONTROL_LINES).format(date=date, n=rng.randint(1, 99), text=text))
            )
        return lines

    def _example(self) -> Lines:
        name = self._name()
        n = self.rng.randint(0, 99)
        return [(0, "Examples"), (0, "--------"), (0, f">>> {name}({n})"), (0, f"[{n}, {n * 2}]")]

    def document(self, target: int) -> Lines:
        """A docstring/README-like document of about `target` characters."""
        rng = self.rng
        title = self._sentence().rstrip(".?!")[:70].rstrip()
        lines: Lines = [(0, title), (0, "=" * len(title))]
        length = 2 * len(title)
        while length < target:
            lines.append((0, ""))
            if rng.random() < 0.1:
                lines.append((0, ""))
            block = rng.choices(
                (self._wrapped, self._code, self._params, self._table, self._log, self._example),
                (45, 25, 12, 5, 8, 5),
            )[0]
            part = self._wrapped(0, rng.randint(2, 8)) if block == self._wrapped else block()
            lines += part
            length += sum(len(t) + 1 for _, t in part) + 1
        return lines

    def banners(self) -> Lines:
        """A document that is nearly all ASCII art: dropped for its symbol ratio."""
        rng = self.rng
        lines: Lines = []
        for _ in range(rng.randint(10, 80)):
            lines.append((0, rng.choice(_BANNERS)))
            if rng.random() < 0.1:
                lines.append((0, f"# {self._name()} #"))
        return lines

    def log_spam(self) -> Lines:
        """The same few lines over and over: dropped for its repeated lines."""
        rng = self.rng
        host = f"{self._name()}.internal:{rng.randint(1024, 65535)}"
        templates = rng.sample(_LOG_SPAM, 2)
        lines: Lines = [(0, self._sentence())]
        for _ in range(rng.randint(40, 300)):
            lines.append((0, rng.choice(templates).format(host=host, n=1, date="2024-01-01")))
        return lines

    # -- rendering: changes that prepare's normalization undoes --

    def render(self, lines: Lines, single_line: bool = False) -> str:
        """A messy rendering of `lines` whose normalized form is `canonical(lines)`.

        Line breaks are LF or CRLF (a bare CR only ever inside CRLF: a document with no LF at
        all is one line to the normalizer); a blank line's break may be a form feed.
        """
        rng = self.rng
        form = rng.random()  # Unicode: NFC as written, all NFD, or NFD and singletons mixed
        eol = "\r\n" if rng.random() < 0.35 else "\n"
        tabs = rng.random() < 0.3
        runs = rng.random() < 0.5
        trailing = rng.random() < 0.6
        out: list[str] = []
        for depth, text in lines:
            if not text:
                out.append(rng.choice(("", "", " ", "\t", "   ", "\u00a0")))
                continue
            if form < 0.25:
                text = unicodedata.normalize("NFD", text)
            elif form < 0.5 and rng.random() < 0.3:
                if rng.random() < 0.5:
                    text = unicodedata.normalize("NFD", text)
                else:
                    for ch, singleton in _SINGLETONS.items():
                        text = text.replace(ch, singleton)
            if runs and " " in text:
                parts = text.split(" ")
                text = parts[0]
                for part in parts[1:]:
                    r = rng.random()
                    sep = " " if r < 0.7 else "  " if r < 0.85 else "\t" if r < 0.95 else " \t  "
                    text += sep + part
            indent = ("\t" * depth) if tabs else ("    " * depth)
            if rng.random() < 0.05:
                indent += " "
            tail = ""
            if trailing and rng.random() < 0.3:  # one line: a no-break space would stay inside
                tail = rng.choice(
                    (" ", "  ", "\t") if single_line else (" ", "\t", " \u00a0", "\u3000")
                )
            out.append(indent + text + tail)
        if single_line:
            body = rng.choice(("  ", "\t", " ")).join(out)
            return rng.choice(("", " ", "\t ")) + body + rng.choice(("", "  ", "\t"))
        body = ""
        for i, line in enumerate(out):
            if i:
                blank_before = not lines[i - 1][1]
                body += "\f" if blank_before and rng.random() < 0.2 else eol
            body += line
        return rng.choice(("", eol, " " + eol, "\t")) + body + rng.choice(("", eol, eol * 2))

    @staticmethod
    def canonical(lines: Lines, single_line: bool = False) -> str:
        return unicodedata.normalize(
            "NFC", (" " if single_line else "\n").join(t for _, t in lines)
        )


def _blank(rng: random.Random) -> str:
    """Whitespace only (normalized: empty)."""
    return "".join(
        rng.choice((" ", "\t", "\r\n", "\n", "\f", "\u3000", "\u00a0"))
        for _ in range(rng.randint(1, 40))
    )


def generate_messy(path: Path, kept_path: Path, size_bytes: int, seed: int = 0) -> Corpus:
    """Write about `size_bytes` of messy JSONL to `path` (see the module docstring)."""
    gen = _MessyGen(seed)
    side = random.Random(seed * 104_729 + 11)
    recent: list[tuple[Lines, bool, str, str]] = []  # kept: lines, single_line, raw, normalized
    seen: set[str] = set()
    dropped: dict[str, int] = {}
    written = records = kept = dups = bad = 0
    with open(path, "wb") as out, open(kept_path, "wb") as kept_out:
        while written < size_bytes:
            r = side.random()
            lines: Lines = []
            single = False
            text = ""
            if r < 0.004:  # bad lines: as in the clean corpus
                kind = side.randrange(5)
                line = _bad_line_of(kind, side, records, gen.prose.document())
                reason = _BAD_REASONS[kind]
                dropped[reason] = dropped.get(reason, 0) + 1
                bad += 1
                out.write(line)
                written += len(line)
                records += 1
                continue
            if r < 0.007:
                raw = _blank(side)
            elif r < 0.027 and recent:  # the same raw text again
                lines, single, raw, text = side.choice(recent)
            elif r < 0.037 and recent:  # the same document, rendered differently
                lines, single, _, text = side.choice(recent)
                raw = gen.render(lines, single)
            else:
                if r < 0.042:
                    lines = gen.banners()
                elif r < 0.047:
                    lines = gen.log_spam()
                elif r < 0.049:
                    lines = gen.document(side.randint(MAX_CHARS, MAX_CHARS * 13 // 10))
                elif r < 0.1:
                    single = True
                    lines = gen._wrapped(0, side.randint(15, 60))
                else:
                    lines = gen.document(int(2000 * 30 ** side.random()))
                raw = gen.render(lines, single)
                text = gen.canonical(lines, single)
            reason = _drop_reason(text)
            if reason is None and text in seen:
                reason = "duplicate"
            if reason is None:
                seen.add(text)
                kept_out.write(json.dumps({"text": text}, ensure_ascii=False).encode() + b"\n")
                kept += 1
                entry = (lines, single, raw, text)
                if len(recent) < 256:
                    recent.append(entry)
                else:
                    recent[side.randrange(256)] = entry
            else:
                dropped[reason] = dropped.get(reason, 0) + 1
                dups += reason == "duplicate"
            line = json.dumps(
                {"id": records, "text": raw, "source": "bench-messy"}, ensure_ascii=False
            )
            data = line.encode() + b"\n"
            out.write(data)
            written += len(data)
            records += 1
    return Corpus(path, kept_path, written, records, kept, dups, bad, "messy", dropped)


# --- the short-record corpus ---------------------------------------------------------------

# Instruction and chat data: the shapes of the prompts (an instruction, a question, a task on
# a quoted sentence) and of the transcripts. {t}, {u}: topics (a few Zipf-weighted words).
_ASKS = [
    "Explain {t} in simple terms.",
    "What is the difference between {t} and {u}?",
    "Write a short note about {t}.",
    "Give three examples of {t}.",
    "How does {t} work?",
    "Why is {t} important for {u}?",
    "Describe {t} to someone who has never seen it.",
    "Can you list the main steps of {t}?",
    "What should I know about {t} before I start?",
    "Compare {t} with {u} in two sentences.",
    "Summarize the following text: {s}",
    "Rewrite this sentence so that it is clearer: {s}",
    "Is this statement true? {s}",
    "Translate into plain English: {s}",
]
_FUNCTION_WORDS = frozenset(_COMMON[:60])  # not topics on their own
_OPENERS = ["", "", "", "Sure. ", "Certainly! ", "Here is a short answer. ", "In short: "]


class _ShortGen:
    """Instruction/response records of a few hundred characters (median about 280)."""

    def __init__(self, seed: int) -> None:
        self.prose = _DocGen(seed)
        self.rng = self.prose.rng

    def _topic(self) -> str:
        n = self.rng.choice((1, 2, 2, 3))
        words = self.rng.choices(self.prose.words, cum_weights=self.prose.cum, k=3 * n)
        return " ".join(([w for w in words if w not in _FUNCTION_WORDS] or words)[:n])

    def prompt(self) -> str:
        rng = self.rng
        ask = rng.choice(_ASKS).format(t=self._topic(), u=self._topic(), s=self.prose.sentence())
        if rng.random() < 0.2:  # some context before the question
            ask = self.prose.sentence() + " " + ask
        return ask

    def response(self) -> str:
        rng, prose = self.rng, self.prose
        if rng.random() < 0.15:  # a short list
            items = [f"{i}. {prose.sentence()}" for i in range(1, rng.randint(2, 4) + 1)]
            return rng.choice(_OPENERS) + "\n".join(items)
        n = int(1 + 4 * rng.random() ** 1.6)
        return rng.choice(_OPENERS) + " ".join(prose.sentence() for _ in range(n))

    def record(self) -> tuple[str, str, str]:
        """(prompt, response, text): the text as a plain-text fine-tune sees it."""
        prompt, response = self.prompt(), self.response()
        if self.rng.random() < 0.3:  # a chat transcript
            text = f"User: {prompt}\nAssistant: {response}"
        else:
            text = f"{prompt}\n\n{response}"
        return prompt, response, text


def generate_short(
    path: Path, kept_path: Path, size_bytes: int, seed: int = 0, dup_rate: float = 0.03
) -> Corpus:
    """Write about `size_bytes` of instruction-like JSONL to `path`, streaming.

    Each record has `text` (what prepare reads, already normalized) and the `prompt` and
    `response` it was made of (as instruction datasets carry them; prepare's default reads
    only `text`). Exact duplicates and bad lines as in the clean corpus.
    """
    gen = _ShortGen(seed)
    side = random.Random(seed * 104_729 + 17)
    recent: list[tuple[str, str, str]] = []
    dropped: dict[str, int] = {}
    written = records = kept = dups = bad = 0
    with open(path, "wb") as out, open(kept_path, "wb") as kept_out:
        while written < size_bytes:
            r = side.random()
            if r < 0.0025:
                kind = side.randrange(5)
                line = _bad_line_of(kind, side, records, gen.record()[2])
                dropped[_BAD_REASONS[kind]] = dropped.get(_BAD_REASONS[kind], 0) + 1
                bad += 1
            else:
                if r < 0.0025 + dup_rate and recent:
                    prompt, response, text = side.choice(recent)
                    dropped["duplicate"] = dropped.get("duplicate", 0) + 1
                    dups += 1
                else:
                    prompt, response, text = gen.record()
                    kept_out.write(json.dumps({"text": text}, ensure_ascii=False).encode() + b"\n")
                    kept += 1
                    if len(recent) < 512:
                        recent.append((prompt, response, text))
                    else:
                        recent[side.randrange(512)] = (prompt, response, text)
                obj = {"id": records, "prompt": prompt, "response": response, "text": text}
                line = json.dumps(obj, ensure_ascii=False).encode() + b"\n"
            out.write(line)
            written += len(line)
            records += 1
    return Corpus(path, kept_path, written, records, kept, dups, bad, "short", dropped)


def ensure_corpus(
    cache_dir: str | Path, size_mb: float, seed: int = 0, kind: str = "clean"
) -> Corpus:
    """The cached corpus of `size_mb` MiB for `seed`, generating it (atomically) if absent."""
    if kind not in KINDS:
        raise ValueError(f"corpus kind {kind!r}: allowed {', '.join(KINDS)}")
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if kind == "clean":
        stem = f"corpus-{size_mb:g}mib-seed{seed}-v{GENERATOR_VERSION}"
    else:
        version = MESSY_VERSION if kind == "messy" else SHORT_VERSION
        stem = f"corpus-{kind}-{size_mb:g}mib-seed{seed}-v{version}"
    path, kept_path = cache / f"{stem}.jsonl", cache / f"{stem}.kept.jsonl"
    meta_path = cache / f"{stem}.json"
    if path.is_file() and kept_path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("size_bytes") == path.stat().st_size:
            return Corpus(path, kept_path, **meta)
    tmp, kept_tmp = path.with_suffix(".tmp"), kept_path.with_suffix(".tmp")
    make = {"clean": generate, "messy": generate_messy, "short": generate_short}[kind]
    c = make(tmp, kept_tmp, int(size_mb * MIB), seed)
    os.replace(kept_tmp, kept_path)
    os.replace(tmp, path)
    keys = ("size_bytes", "records", "kept", "duplicates", "bad", "kind", "dropped")
    meta = {k: getattr(c, k) for k in keys}
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
    ap.add_argument("--kind", choices=KINDS, default="clean")
    ap.add_argument("--cache-dir", default="runs/bench")
    args = ap.parse_args(argv)
    c = ensure_corpus(args.cache_dir, args.size_mb, args.seed, args.kind)
    print(
        f"{c.path}: {c.size_bytes / MIB:.1f} MiB, {c.records} records, {c.kept} kept, "
        f"{c.duplicates} duplicates, {c.bad} bad lines"
        + (f", dropped by reason {c.dropped}" if c.dropped else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
