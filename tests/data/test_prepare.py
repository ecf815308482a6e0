"""prepare_data: counts reconcile, nothing dropped silently, output is deterministic."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kubellm.data.prepare import DataError, PrepareParams, is_validation, normalize, prepare


def _small(**kw) -> PrepareParams:
    return PrepareParams(**{"num_records": 3000, "vocab_size": 300, "seq_len": 16, **kw})


def test_synthetic_dataset_contract(tmp_path: Path) -> None:
    m = prepare(_small(), tmp_path)
    rec = m["records"]
    assert rec["read"] == 3000
    assert rec["read"] == rec["kept"] + sum(rec["dropped"].values())
    assert rec["dropped"]["duplicate"] > 0  # the generator samples pairs with replacement
    assert rec["train"] + rec["val"] == rec["kept"]
    assert rec["eval_examples"] == rec["val"]
    for split in ("train", "val"):
        table = pq.read_table(tmp_path / split / "shard-00000.parquet")
        assert str(table.schema.field("input_ids").type) == "list<element: int32>"
        assert {len(r) for r in table.column("input_ids").to_pylist()} == {16}
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "manifest.json").read_text()) == m
    assert len(m["source_fingerprint"]) == 64


def test_rerun_is_byte_identical(tmp_path: Path) -> None:
    a, b = prepare(_small(), tmp_path / "a"), prepare(_small(), tmp_path / "b")
    assert a["source_fingerprint"] == b["source_fingerprint"]
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert prepare(_small(seed=1), tmp_path / "c")["source_fingerprint"] != a["source_fingerprint"]


def test_split_is_by_content_and_stable() -> None:
    texts = [f"doc {i}" for i in range(2000)]
    first = {t for t in texts if is_validation(t, 0.1)}
    appended = texts + [f"new {i}" for i in range(500)]
    assert first == {t for t in appended[:2000] if is_validation(t, 0.1)}
    assert 120 < len(first) < 280


def test_normalize_folds_whitespace_and_nfc() -> None:
    assert normalize("  e\u0301  x\t\ty \n  z  ") == "\u00e9 x y\nz"


def _jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


BAD_LINES = [
    b'{"text": "good one"}',
    b'{"text": "good one"}',  # duplicate
    b"{not json",
    b'{"body": "no text field"}',
    b'{"text": 5}',
    b'{"text": "   "}',
    b'{"text": "bad \xff utf8"}',
] + [f'{{"text": "record {i} with words"}}'.encode() for i in range(60)]


def test_bad_lines_are_counted_by_reason(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", BAD_LINES)
    m = prepare(_small(source=str(src), vocab_size=280, seq_len=8), tmp_path / "out")
    assert m["records"]["dropped"] == {
        "duplicate": 1,
        "empty": 1,
        "invalid_utf8": 1,
        "malformed_json": 1,
        "missing_text": 2,
    }
    assert m["records"]["read"] == len(BAD_LINES)
    assert m["records"]["kept"] == 61


@pytest.mark.parametrize(
    ("line", "reason"),
    [(b"{not json", "malformed json"), (b'{"body": 1}', "missing text"), (b'"\xff"', "utf8")],
)
def test_strict_mode_names_file_and_line(tmp_path: Path, line: bytes, reason: str) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [b'{"text": "fine"}', line])
    with pytest.raises(DataError, match=rf"in\.jsonl:2.*{reason}"):
        prepare(_small(source=str(src), on_error="fail"), tmp_path / "out")


def test_nothing_kept_says_which_filter(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [b'{"text": "  "}'] * 5)
    with pytest.raises(DataError, match=r"read 5, kept 0, dropped by reason: empty=5"):
        prepare(_small(source=str(src)), tmp_path / "out")


def test_missing_source_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="matches no file"):
        prepare(_small(source=str(tmp_path / "nope*.jsonl")), tmp_path / "out")


def test_prompt_is_masked_out_of_the_loss(tmp_path: Path) -> None:
    m = prepare(_small(), tmp_path / "masked")
    table = pq.read_table(tmp_path / "masked" / "train" / "shard-00000.parquet")
    ids = table.column("input_ids").to_pylist()[0]
    mask = table.column("loss_mask").to_pylist()[0]
    assert len(mask) == len(ids) and 0 < sum(mask) < len(mask)
    assert m["loss_masked_documents"] == m["records"]["kept"]
    plain = prepare(_small(mask_prompt=False), tmp_path / "plain")
    table = pq.read_table(tmp_path / "plain" / "train" / "shard-00000.parquet")
    assert table.column_names == ["input_ids"]
    assert plain["tokens"]["train"] == m["tokens"]["train"]  # same tokens, only the mask differs


def _jsonl_texts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _words(i: int, n: int = 30) -> str:
    rng = random.Random(i)
    return " ".join(f"w{rng.randint(0, 500)}" for _ in range(n)) + f" doc{i}"


def test_filters_count_each_reason(tmp_path: Path) -> None:
    texts = [_words(i) for i in range(80)]
    texts += ["<<>>{{}}[[]]##$$%%^^&&**" * 3]  # symbols
    texts += ["same line\n" * 5 + "other"]  # repeated lines: 4 of 6 lines repeat
    texts += ["x" * 500]  # too long for max_chars=400
    texts += [_words(3)]  # exact duplicate
    src = _jsonl_texts(tmp_path / "in.jsonl", texts)
    m = prepare(_small(source=str(src), vocab_size=300, seq_len=8, max_chars=400), tmp_path / "o")
    assert m["records"]["dropped"] == {
        "duplicate": 1,
        "repeated_lines": 1,
        "symbol_ratio": 1,
        "too_long": 1,
    }
    assert m["records"]["read"] == len(texts) == m["records"]["kept"] + 4


def test_enormous_document_fails_strict_mode_with_its_line(tmp_path: Path) -> None:
    src = _jsonl_texts(tmp_path / "in.jsonl", [_words(1), "y" * 5000])
    with pytest.raises(DataError, match=r"in\.jsonl:2: too long: 5000 characters > max_chars"):
        prepare(_small(source=str(src), max_chars=1000, on_error="fail"), tmp_path / "o")


def test_near_duplicates_are_dropped_when_asked(tmp_path: Path) -> None:
    base = [_words(i, 60) for i in range(60)]
    near = [t.replace("doc", "Doc", 1) + " tail" for t in base[:10]]  # one-word edits
    src = _jsonl_texts(tmp_path / "in.jsonl", base + near)
    off = prepare(_small(source=str(src), vocab_size=300, seq_len=8), tmp_path / "off")
    on = prepare(
        _small(source=str(src), vocab_size=300, seq_len=8, near_dedup=True), tmp_path / "on"
    )
    assert "near_duplicate" not in off["records"]["dropped"]
    # LSH is probabilistic (seeded, so this run is exact): most near copies caught, and no
    # original lost (the 60 distinct bases all stay)
    assert 8 <= on["records"]["dropped"]["near_duplicate"] <= 10
    assert on["records"]["kept"] >= 60


def test_best_fit_reports_padding_and_keeps_documents_whole(tmp_path: Path) -> None:
    concat = prepare(_small(), tmp_path / "c")
    best = prepare(_small(packing="best_fit"), tmp_path / "b")
    assert concat["packing"]["padding_pct"] == 0 and concat["packing"]["cropped_pct"] > 0
    assert best["packing"]["cropped_pct"] == 0 and best["packing"]["padding_pct"] > 0
    table = pq.read_table(tmp_path / "b" / "train" / "shard-00000.parquet")
    row = table.column("input_ids").to_pylist()[0]
    mask = table.column("loss_mask").to_pylist()[0]
    eos = best["tokenizer"]["eos_id"]
    pad = best["tokenizer"]["pad_id"]
    assert row[-1] in (eos, pad)  # rows end on a document boundary
    assert all(m == 0 for t, m in zip(row, mask, strict=True) if t == pad and pad != eos)


def test_appending_documents_keeps_validation_assignments(tmp_path: Path) -> None:
    first = [_words(i) for i in range(300)]
    more = first + [_words(i) for i in range(300, 450)]
    a = prepare(_small(source=str(_jsonl_texts(tmp_path / "a.jsonl", first))), tmp_path / "a")
    b = prepare(_small(source=str(_jsonl_texts(tmp_path / "b.jsonl", more))), tmp_path / "b")
    held_a = {t for t in first if is_validation(normalize(t), 0.1)}
    assert a["records"]["val"] == len(held_a)
    held_b = {t for t in more if is_validation(normalize(t), 0.1)}
    assert held_a <= held_b and b["records"]["val"] == len(held_b)
    assert a["source_fingerprint"] != b["source_fingerprint"]


def test_pretrained_tokenizer_directory_is_used(tmp_path: Path) -> None:
    first = prepare(_small(), tmp_path / "first")
    again = prepare(_small(tokenizer=str(tmp_path / "first" / "tokenizer")), tmp_path / "again")
    assert again["tokenizer"]["kind"] == "pretrained"
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in first["shards"]]


def test_manifest_records_every_parameter_and_progress(tmp_path: Path, capsys) -> None:
    m = prepare(_small(progress_s=1e-9), tmp_path / "o")
    assert set(m["params"]) == set(vars(PrepareParams()))
    err = capsys.readouterr().err
    assert "prepare: records=" in err and "/s) kept=" in err and "tokens_per_sec=" in err
