"""prepare_data: counts reconcile, nothing dropped silently, output is deterministic."""

from __future__ import annotations

import json
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
