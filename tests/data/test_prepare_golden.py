"""prepare's outputs on a fixture corpus, value for value, against the figures of the code
before issue 21's hot-path work (commit 3029868).

The per-record path (reading, cleaning, hashing, batching the tokenizer calls, writing) was
reworked for short records; these cases hold it to what it made before: the same source
fingerprint, the same counts by drop reason, the same shards and the same held-out
examples. A shard is compared by what prepare decides in it (its columns and their types,
its row groups, its codec and every value), not by its file's sha256: the file also
records the writer's version (`created_by: parquet-cpp-arrow version 25.0.1`), so a new
pyarrow release changes the bytes of the same table (CI, on pyarrow 26.0.1).

The fixture exercises every branch of that path: JSONL and Parquet, a BOM, CRLF and blank
lines, bad lines of each kind, lone surrogates, text that normalization changes
(whitespace, NFD), each filter, exact and near duplicates, prompt/completion pairs whose
parts do and do not make up the text, tokenizer batches cut by count, and both packings.

If a deliberate change alters these outputs (a new tokenizers release, a new rule),
regenerate the figures with `python tests/data/test_prepare_golden.py` and say why in the
commit.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kubellm.data.prepare import PrepareParams, prepare

WORDS = [
    "the",
    "of",
    "and",
    "to",
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
]
WORDS += ["café", "naïve", "Zürich", "東京", "😀", "résumé", "straße", "ﬁne", "Å", "x2"]


def _text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        w = rng.choice(WORDS) if rng.random() < 0.6 else f"w{rng.randint(0, 400)}"
        out.append(w)
    return " ".join(out) + rng.choice(".?!")


def _messy(rng: random.Random, text: str) -> str:
    """Changes normalization undoes: spaces, tabs, CRLF, NFD, line-edge blanks."""
    r = rng.random()
    if r < 0.2:
        return "  " + text.replace(" ", "\t", 2) + "  "
    if r < 0.3:
        return text.replace(" ", " \r\n ", 1)
    if r < 0.4:
        import unicodedata

        return unicodedata.normalize("NFD", text)
    if r < 0.5:
        return text.replace(" ", "   ", 3) + "\n\n" + text[::-1]
    return text


def fixture(dir: Path) -> str:
    """Write the fixture corpus under `dir`; returns its source string."""
    rng = random.Random(21)
    lines: list[bytes] = []
    recent: list[bytes] = []
    bases: list[str] = []
    for i in range(900):
        r = rng.random()
        if r < 0.03:
            lines.append(rng.choice([b"{not json", b'{"text": "bad \xff utf8"}', b'{"body": 1}']))
        elif r < 0.05:
            lines.append(rng.choice([b'{"text": null}', b'{"text": "  \\t "}', b"[1, 2]", b""]))
        elif r < 0.06:
            lines.append(b'{"text": "lone \\ud800 surrogate"}')
        elif r < 0.09 and recent:
            lines.append(rng.choice(recent))  # an exact duplicate line
        elif r < 0.11:
            lines.append(json.dumps({"text": "#" * 30 + " ## !! ** ++"}).encode())
        elif r < 0.13:
            lines.append(json.dumps({"text": "same line\n" * 6}).encode())
        elif r < 0.14:
            lines.append(json.dumps({"text": _text(rng, 400)}).encode())  # over max_chars
        elif r < 0.15:
            lines.append(json.dumps({"text": "tiny"}).encode())  # under min_chars
        elif r < 0.18:  # a near duplicate of an earlier long text: one word changed
            base = bases[rng.randrange(len(bases))] if bases else _text(rng, 80)
            bases.append(base)
            near = base[: base.rindex(" ")] + f" z{rng.randint(0, 10**6)}."
            lines.append(json.dumps({"text": near}).encode())
        elif r < 0.30:
            p, c = _text(rng, rng.randint(3, 12)), " " + _text(rng, rng.randint(2, 30))
            if rng.random() < 0.2:
                p = _messy(rng, p)
            text = p + c if rng.random() < 0.85 else _text(rng, 9)
            lines.append(json.dumps({"text": text, "prompt": p, "completion": c}).encode())
        else:
            obj: dict[str, Any] = {"id": i, "text": _messy(rng, _text(rng, rng.randint(3, 60)))}
            line = json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode()
            recent.append(line)
            lines.append(line)
    lines[0] = b"\xef\xbb\xbf" + lines[0]
    body = b"\n".join(lines).replace(b"\n", b"\r\n", 40) + b"\n\n"
    (dir / "a.jsonl").write_bytes(body)
    texts: list[Any] = [_messy(rng, _text(rng, rng.randint(2, 40))) for _ in range(300)]
    texts[5] = None
    texts[7] = texts[3]
    pq.write_table(
        pa.table({"text": pa.array(texts, pa.string())}), dir / "b.parquet", row_group_size=128
    )
    return f"{dir / 'a.jsonl'},{dir / 'b.parquet'}"


CASES: dict[str, dict[str, Any]] = {
    "concat": {"batch_records": 7},
    "best_fit_near": {"packing": "best_fit", "near_dedup": True, "mask_prompt": False},
}


def shard_digest(path: Path) -> str:
    """sha256 of a shard's content as prepare decides it, the same under any pyarrow that
    reads it: each column's name, type and codec, the rows in each row group, the values."""
    f = pq.ParquetFile(path)
    schema = f.schema_arrow

    def kind(t: pa.DataType) -> str:  # a list's child is named by the reader, not by prepare
        return f"list<{t.value_type}>" if pa.types.is_list(t) else str(t)

    layout = {
        "columns": [
            [
                field.name,
                kind(field.type),
                f.metadata.row_group(0).column(i).compression,
            ]
            for i, field in enumerate(schema)
        ],
        "row_groups": [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)],
        "values": f.read().to_pydict(),
    }
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()


def run_case(tmp: Path, name: str) -> dict[str, Any]:
    """The figures the test compares: everything prepare wrote that its input decides."""
    src = tmp / "src"
    src.mkdir(exist_ok=True)
    params = PrepareParams(
        source=fixture(src),
        vocab_size=300,
        seq_len=24,
        max_chars=1500,
        val_fraction=0.3,
        min_chars=5,
        progress_s=0,
        **CASES[name],
    )
    out = tmp / name
    m = prepare(params, out)
    examples = pq.read_table(out / "eval" / "examples.parquet").to_pylist()
    return {
        "source_fingerprint": m["source_fingerprint"],
        "records": m["records"],
        "tokens": m["tokens"],
        "rows": m["rows"],
        "loss_masked_documents": m["loss_masked_documents"],
        "shards": [(s["name"], s["rows"], shard_digest(out / s["name"])) for s in m["shards"]],
        "examples": len(examples),
        "examples_head": examples[:3],
    }


GOLDEN_PATH = Path(__file__).with_name("prepare_golden.json")


@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_match_the_code_before_issue_21(tmp_path: Path, name: str) -> None:
    golden = json.loads(GOLDEN_PATH.read_text())[name]
    got = json.loads(json.dumps(run_case(tmp_path, name)))  # tuples as lists, like the file
    assert got == golden


if __name__ == "__main__":  # regenerate the figures
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        figures = {name: run_case(Path(d), name) for name in sorted(CASES)}
    GOLDEN_PATH.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {GOLDEN_PATH}", file=sys.stderr)


ODD_LINES = [
    b'{"text": "a", "n": -NaN}',
    b'{"text": "a", "n": NaN, "m": -Infinity}',
    b'{"text": "a", "text": "b"}',
    b'{"text": "a", "te\\u0078t": "b"}',
    b'{"text": "a", "x": 1, "x": 2}',
    b'{"text": 5}',
    b'{"text": null}',
    b"{}",
    b'{"text": "a", "prompt": 3, "completion": "c"}',
    b'{"text": "pc", "prompt": "p", "completion": "c"}',
    b'{"text": "pc", "prompt": "p"}',
    b'{"text": "a", "n": 1e999}',
    b'{"text": "a", "n": 123456789012345678901234567890}',
    b'{"text": "tab\tinside"}',
    b'{"text": "a", "x": "bad \xff"}',
    b'{"text": "a", "x\xff": 1}',
    b'{"text": "a", "x": "\\ud800"}',
    b'{"text": "lone \\udc00"}',
    b'{"text": "pair \\ud83d\\ude00"}',
    b'{"text": "a"} {"text": "b"}',
    b'{"text": "a"}{"text": "b"}',
    b'{"text": "a"}  ',
    b'{"text": "a"}\r',
    b'  {"text": "lead"}',
    b'{"text": "a", "nested": {"text": 1, "deep": [[[{"a": null}]]]}}',
    b'{"text": "\\u0000nul"}',
    b'{"text": "caf\xc3\xa9 \xe6\x9d\xb1"}',
    b'{"text": "a",}',
    b"[1, 2]",
    b'"just a string"',
    b"",
    b"   ",
    b'{"text": "a", "n": 01}',
    b'{"text": "a"} // comment',
    b"\xef\xbb\xbf" + b'{"text": "bom"}',
]


@pytest.mark.parametrize("seed", range(4))
def test_jsonl_batches_read_as_line_by_line(tmp_path: Path, seed: int) -> None:
    """Arrow's batches give exactly the records and counts of Python's line-by-line read."""
    from kubellm.data import sources
    from kubellm.data.records import Counts

    rng = random.Random(seed)
    lines = []
    for i in range(3000):
        if rng.random() < 0.02:
            lines.append(rng.choice(ODD_LINES))
        else:
            obj: dict[str, Any] = {"id": i, "text": _text(rng, rng.randint(1, 30))}
            if rng.random() < 0.1:
                obj.update(prompt="p", completion="c")
            lines.append(json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode())
    if seed % 2:
        lines[0] = ODD_LINES[-1]  # a BOM on line 1
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b"\n".join(lines) + (b"\n" if seed < 2 else b""))

    def read(fast: bool) -> tuple[list[tuple[Any, ...]], Counts]:
        counts = Counts()
        opts = sources.SourceOptions()
        if fast:
            recs = list(sources.read_records(str(path), opts, counts))
        else:  # the reference: every line through _jsonl_rows and _to_record
            recs = []
            f = sources._resolve(str(path))[0]
            with open(path, "rb") as fh:
                for where, row in sources._jsonl_rows(f, fh):
                    counts.read += 1
                    rec = sources._to_record(row, where, opts, counts)
                    if rec is not None:
                        recs.append(rec)
        return [(r.text, r.where, r.prompt, r.completion) for r in recs], counts

    (fast, fast_counts), (slow, slow_counts) = read(True), read(False)
    assert fast == slow
    assert (fast_counts.read, dict(fast_counts.dropped)) == (
        slow_counts.read,
        dict(slow_counts.dropped),
    )
