"""Sources: every format and source form reads, every bad input is counted or stops the stage.

Each test drains the reader and checks that the counts reconcile the way prepare_data relies
on: every record read is yielded (kept, here) or dropped under a reason.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from kubellm.data.records import Counts, DataError, Record
from kubellm.data.sources import SourceOptions, read_records, source_files

DEFAULT = SourceOptions()


def drain(source: str, opts: SourceOptions = DEFAULT) -> tuple[list[Record], Counts]:
    counts = Counts()
    records = list(read_records(source, opts, counts))
    assert counts.read == len(records) + sum(counts.dropped.values()), counts
    return records, counts


def jsonl(*rows: object) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def zst_frames(*chunks: bytes) -> bytes:
    """Several zstd frames back to back, as `zstd -c a >> f` leaves them."""
    return b"".join(zstandard.ZstdCompressor().compress(c) for c in chunks)


def write_parquet(table: pa.Table, row_group_size: int | None = None) -> Callable[[Path], None]:
    return lambda p: pq.write_table(table, p, row_group_size=row_group_size)


def save_hf(data: dict[str, list[object]], num_shards: int = 1) -> Callable[[Path], None]:
    def write(p: Path) -> None:
        import datasets

        datasets.Dataset.from_dict(data).save_to_disk(str(p), num_shards=num_shards)

    return write


def write_arrow_file(table: pa.Table) -> Callable[[Path], None]:
    """The Arrow IPC *file* format (Feather v2), as opposed to the stream `datasets` writes."""

    def write(p: Path) -> None:
        with pa.OSFile(str(p), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=2):
                w.write_batch(batch)

    return write


def put(path: Path, content: bytes | Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        content(path)


# --- formats -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatCase:
    name: str
    filename: str
    content: bytes | Callable[[Path], None]
    texts: list[str]
    wheres: list[str]  # relative to the test's directory
    opts: SourceOptions = DEFAULT


MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
CHAT = "<|user|>\nhi\n<|assistant|>\nyo"  # the default chat format; prepare appends EOS

FORMAT_CASES = [
    FormatCase(
        "jsonl, blank lines skipped, line numbers kept",
        "a.jsonl",
        jsonl({"text": "alpha"}) + b"\n   \n" + jsonl({"text": "beta", "id": 7}),
        ["alpha", "beta"],
        ["a.jsonl:1", "a.jsonl:4"],
    ),
    FormatCase(
        "json extension and a BOM",
        "a.json",
        b"\xef\xbb\xbf" + jsonl({"text": "bom"}),
        ["bom"],
        ["a.json:1"],
    ),
    FormatCase(
        "jsonl.gz",
        "a.jsonl.gz",
        gzip.compress(jsonl({"text": "g1"}, {"text": "g2"})),
        ["g1", "g2"],
        ["a.jsonl.gz:1", "a.jsonl.gz:2"],
    ),
    FormatCase(
        "jsonl.zst with two frames",
        "a.jsonl.zst",
        zst_frames(jsonl({"text": "z1"}), jsonl({"text": "z2"})),
        ["z1", "z2"],
        ["a.jsonl.zst:1", "a.jsonl.zst:2"],
    ),
    FormatCase(
        "parquet across row groups and batches",
        "a.parquet",
        write_parquet(pa.table({"text": [f"p{i}" for i in range(5)], "n": range(5)}), 2),
        [f"p{i}" for i in range(5)],
        [f"a.parquet:row {i}" for i in range(5)],
    ),
    FormatCase(
        "text, a document per file",
        "a.txt",
        b"first line\n\nsecond line\n",
        ["first line\n\nsecond line\n"],
        ["a.txt"],
    ),
    FormatCase(
        "text, a document per line",
        "a.txt",
        b"one\n\n  \ntwo\r\nthree",
        ["one", "two", "three"],
        ["a.txt:1", "a.txt:4", "a.txt:5"],
        SourceOptions(text_mode="line"),
    ),
    FormatCase(
        "text.zst per line",
        "a.txt.zst",
        zst_frames(b"l1\nl2\n"),
        ["l1", "l2"],
        ["a.txt.zst:1", "a.txt.zst:2"],
        SourceOptions(text_mode="line"),
    ),
    FormatCase(
        "saved Hugging Face dataset, two shards in state.json order",
        "ds",
        save_hf({"text": ["h0", "h1", "h2"]}, num_shards=2),
        ["h0", "h1", "h2"],
        [
            "ds/data-00000-of-00002.arrow:row 0",
            "ds/data-00000-of-00002.arrow:row 1",
            "ds/data-00001-of-00002.arrow:row 0",
        ],
    ),
    FormatCase(
        "Arrow IPC file format",
        "a.arrow",
        write_arrow_file(pa.table({"text": ["f0", "f1", "f2"]})),
        ["f0", "f1", "f2"],
        ["a.arrow:row 0", "a.arrow:row 1", "a.arrow:row 2"],
    ),
    FormatCase(
        "forced format for an unknown extension, custom text field",
        "a.log",
        jsonl({"body": "forced"}),
        ["forced"],
        ["a.log:1"],
        SourceOptions(format="jsonl", text_field="body"),
    ),
    FormatCase(
        "prompt_response template with custom fields",
        "a.jsonl",
        jsonl({"instruction": "Add 1 and 1.", "output": "2"}),
        ["<|user|>\nAdd 1 and 1.\n<|assistant|>\n2"],
        ["a.jsonl:1"],
        SourceOptions(
            template="prompt_response", prompt_field="instruction", response_field="output"
        ),
    ),
    FormatCase(
        "messages template from parquet list<struct>",
        "a.parquet",
        write_parquet(pa.table({"messages": [MSGS, MSGS]})),
        [CHAT, CHAT],
        ["a.parquet:row 0", "a.parquet:row 1"],
        SourceOptions(template="messages"),
    ),
    FormatCase(
        "messages template from a saved dataset",
        "ds",
        save_hf({"messages": [MSGS]}),
        [CHAT],
        ["ds/data-00000-of-00001.arrow:row 0"],
        SourceOptions(template="messages"),
    ),
]


@pytest.mark.parametrize("case", FORMAT_CASES, ids=lambda c: c.name)
def test_format(tmp_path: Path, case: FormatCase) -> None:
    put(tmp_path / case.filename, case.content)
    records, counts = drain(str(tmp_path / case.filename), case.opts)
    assert [r.text for r in records] == case.texts
    assert [r.where for r in records] == [f"{tmp_path}/{w}" for w in case.wheres]
    assert counts.read == len(case.texts)
    assert not counts.dropped
    if case.opts.template != "none":
        assert all(r.is_pair and r.text == f"{r.prompt}{r.completion}" for r in records)


def test_prompt_response_split_is_exact(tmp_path: Path) -> None:
    put(tmp_path / "a.jsonl", jsonl({"prompt": "q", "response": "a"}))
    (rec,), _ = drain(str(tmp_path / "a.jsonl"), SourceOptions(template="prompt_response"))
    assert (rec.prompt, rec.completion) == ("<|user|>\nq\n<|assistant|>\n", "a")
    assert rec.segments == ((rec.prompt, False), ("a", True))


def test_prompt_completion_fields_kept_without_template(tmp_path: Path) -> None:
    put(
        tmp_path / "sft.jsonl",
        jsonl(
            {"text": "1+1=2", "prompt": "1+1=", "completion": "2"},
            {"text": "plain"},
            {"text": "odd", "prompt": "o", "completion": 3},  # not a pair: kept as plain text
        ),
    )
    records, _ = drain(str(tmp_path / "sft.jsonl"))
    pairs = [(r.prompt, r.completion) for r in records]
    assert pairs == [("1+1=", "2"), (None, None), (None, None)]
    assert records[0].is_pair and not records[2].is_pair


def test_synthetic() -> None:
    records, counts = drain("synthetic", SourceOptions(num_records=5, seed=3))
    assert counts.read == 5
    assert [r.where for r in records] == [f"synthetic:{i}" for i in range(1, 6)]
    assert all(r.is_pair and r.text == f"{r.prompt}{r.completion}" for r in records)
    again, _ = drain("synthetic", SourceOptions(num_records=5, seed=3))
    assert again == records
    assert source_files("synthetic") == []


# --- source forms ------------------------------------------------------------------------------


def test_glob_sorted_and_only_matching(tmp_path: Path) -> None:
    put(tmp_path / "b.jsonl", jsonl({"text": "b"}))
    put(tmp_path / "a.jsonl", jsonl({"text": "a"}))
    put(tmp_path / "c.txt", b"not matched")
    records, _ = drain(str(tmp_path / "*.jsonl"))
    assert [r.text for r in records] == ["a", "b"]
    assert source_files(str(tmp_path / "*.jsonl")) == [
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.jsonl"),
    ]


def test_directory_recursive_sorted_skips_hidden(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    put(root / "b.jsonl", jsonl({"text": "b"}))
    put(root / "a" / "x.txt", b"ax")
    put(root / "a" / "y.jsonl.gz", gzip.compress(jsonl({"text": "ay"})))
    put(root / "_SUCCESS", b"")
    put(root / ".part.jsonl.crc", b"\x00")
    put(root / "_temporary" / "t.jsonl", jsonl({"text": "temp"}))
    expected = ["a/x.txt", "a/y.jsonl.gz", "b.jsonl"]
    assert source_files(str(root)) == [str(root / p) for p in expected]
    records, counts = drain(str(root) + "/")
    assert [r.text for r in records] == ["ax", "ay", "b"]
    assert counts.read == 3


def test_dataset_dict_directory_reads_each_split_and_no_cache_files(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["s0", "s1"]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    # a cache file `datasets` can leave beside the data is not part of the dataset
    pq.write_table(pa.table({"text": ["stale"]}), tmp_path / "dd" / "train" / "x.parquet")
    (tmp_path / "dd" / "train" / "cache-123.arrow").write_bytes(b"junk")
    files = source_files(str(tmp_path / "dd"))
    assert files == [
        str(tmp_path / "dd" / split / "data-00000-of-00001.arrow") for split in ("test", "train")
    ]
    records, _ = drain(str(tmp_path / "dd" / "train"))
    assert [r.text for r in records] == ["s0", "s1"]


def test_comma_separated_sources_in_order(tmp_path: Path) -> None:
    put(tmp_path / "a.jsonl", jsonl({"text": "a"}))
    put(tmp_path / "b.parquet", write_parquet(pa.table({"text": ["b"]})))
    source = f"{tmp_path / 'b.parquet'}, synthetic ,{tmp_path / 'a.jsonl'}"
    records, counts = drain(source, SourceOptions(num_records=2))
    assert [r.where.rsplit("/", 1)[-1] for r in records] == [
        "b.parquet:row 0",
        "synthetic:1",
        "synthetic:2",
        "a.jsonl:1",
    ]
    assert counts.read == 4
    assert source_files(source) == [str(tmp_path / "b.parquet"), str(tmp_path / "a.jsonl")]


def test_relative_paths_stay_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put(tmp_path / "data" / "a.jsonl", jsonl({"text": "x"}, {"text": 1}))
    monkeypatch.chdir(tmp_path)
    records, _ = drain("data/*.jsonl")
    assert records[0].where == os.path.join("data", "a.jsonl") + ":1"
    with pytest.raises(DataError, match=re.escape("data/a.jsonl:2: missing text")):
        drain("data", SourceOptions(on_error="fail"))


def test_file_uri(tmp_path: Path) -> None:
    put(tmp_path / "a.jsonl", jsonl({"text": "u"}))
    records, _ = drain(f"file://{tmp_path}/*.jsonl")
    assert [r.where for r in records] == [f"file://{tmp_path}/a.jsonl:1"]


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A private folder on fsspec's in-process memory filesystem, removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/kubellm-test-{uuid.uuid4().hex}"
    yield root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_memory_uri_glob_and_directory(memory_root: str) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{memory_root}/c/b.jsonl.gz", gzip.compress(jsonl({"text": "m2"}, {"nope": 1})))
    fs.pipe(f"{memory_root}/c/a.jsonl", jsonl({"text": "m1"}))
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": ["m3"]}), buf)
    fs.pipe(f"{memory_root}/c/sub/c.parquet", buf.getvalue().to_pybytes())
    base = f"memory://{memory_root}/c"
    records, counts = drain(f"{base}/*.jsonl*")
    assert [(r.text, r.where) for r in records] == [
        ("m1", f"{base}/a.jsonl:1"),
        ("m2", f"{base}/b.jsonl.gz:1"),
    ]
    assert counts.dropped == {"missing_text": 1}
    records, counts = drain(base)
    assert [r.text for r in records] == ["m1", "m2", "m3"]
    assert source_files(base) == [f"{base}/a.jsonl", f"{base}/b.jsonl.gz", f"{base}/sub/c.parquet"]


# --- bad input ---------------------------------------------------------------------------------


def _broken_link(p: Path) -> None:
    p.symlink_to(p.parent / "gone.jsonl")  # listed by the directory walk, fails to open


def _truncated(compress: Callable[[bytes], bytes], lines: int = 20_000) -> bytes:
    """A file of several compressed blocks, cut short: some lines decode, then it fails."""
    data = b"".join(
        b'{"text": "%d %s"}\n' % (i, os.urandom(8).hex().encode()) for i in range(lines)
    )
    full = compress(data)
    return full[: len(full) - 40]


@dataclass(frozen=True)
class BadCase:
    name: str
    filename: str
    content: bytes | Callable[[Path], None]
    reason: str
    where: str  # appended to the file's path in the message: ":2", ":row 1" or ""
    detail: str  # a fragment of the reason's detail
    kept: int | None = 0  # None: some, but not all (a file cut off mid-way)
    dropped: int = 1
    opts: SourceOptions = field(default_factory=SourceOptions)


PR = SourceOptions(template="prompt_response")
CHAT_OPTS = SourceOptions(template="messages")
LINES = SourceOptions(text_mode="line")

BAD_CASES = [
    BadCase(
        "malformed json",
        "a.jsonl",
        jsonl({"text": "ok"}) + b'{"text": oops}\n',
        "malformed_json",
        ":2",
        "Expecting value: line 1 column 10",
        kept=1,
    ),
    BadCase(
        "text field absent", "a.jsonl", jsonl({"body": "x"}), "missing_text", ":1", "is missing"
    ),
    BadCase(
        "text field not a string",
        "a.jsonl",
        jsonl({"text": "ok"}, {"text": 5}),
        "missing_text",
        ":2",
        "'text' is int, not a string",
        kept=1,
    ),
    BadCase(
        "custom text field absent",
        "a.jsonl",
        jsonl({"text": "x"}),
        "missing_text",
        ":1",
        "'body' is missing",
        opts=SourceOptions(text_field="body"),
    ),
    BadCase(
        "line not an object",
        "a.jsonl",
        jsonl(["text"]),
        "missing_text",
        ":1",
        "JSON list, not an object",
    ),
    BadCase(
        "invalid utf-8 in jsonl",
        "a.jsonl",
        jsonl({"text": "ok"}) + b'{"text": "\xff"}\n',
        "invalid_utf8",
        ":2",
        "can't decode byte 0xff",
        kept=1,
    ),
    BadCase(
        "lone surrogate escape in jsonl",
        "a.jsonl",
        b'{"text": "a\\ud800b"}\n',
        "invalid_utf8",
        ":1",
        "lone surrogate",
    ),
    BadCase(
        "invalid utf-8 in a text line",
        "a.txt",
        b"ok\n\xfe oops\n",
        "invalid_utf8",
        ":2",
        "can't decode byte 0xfe",
        kept=1,
        opts=LINES,
    ),
    BadCase(
        "invalid utf-8 in a text file",
        "a.txt",
        b"ok \xfe",
        "invalid_utf8",
        "",
        "position 3",
    ),
    BadCase(
        "parquet without the text column",
        "a.parquet",
        write_parquet(pa.table({"body": ["x", "y"]})),
        "missing_text",
        ":row 0",
        "'text' is missing",
        dropped=2,
    ),
    BadCase(
        "parquet text column not strings",
        "a.parquet",
        write_parquet(pa.table({"text": [1, 2]})),
        "missing_text",
        ":row 0",
        "'text' is int",
        dropped=2,
    ),
    BadCase(
        "parquet null text",
        "a.parquet",
        write_parquet(pa.table({"text": ["ok", None]})),
        "missing_text",
        ":row 1",
        "'text' is missing",
        kept=1,
    ),
    BadCase(
        "prompt_response without the response",
        "a.jsonl",
        jsonl({"prompt": "q", "response": "a"}, {"prompt": "q"}),
        "bad_template",
        ":2",
        "field 'response' is missing",
        kept=1,
        opts=PR,
    ),
    BadCase(
        "prompt_response with a non-string prompt",
        "a.jsonl",
        jsonl({"prompt": ["q"], "response": "a"}),
        "bad_template",
        ":1",
        "field 'prompt' is list",
        opts=PR,
    ),
    BadCase(
        "template on a line that is not an object",
        "a.jsonl",
        jsonl("just a string"),
        "bad_template",
        ":1",
        "JSON str, not an object",
        opts=PR,
    ),
    BadCase(
        "messages not ending with the assistant",
        "a.jsonl",
        jsonl({"messages": MSGS}, {"messages": MSGS[:1]}),
        "bad_template",
        ":2",
        "last message is from 'user'",
        kept=1,
        opts=CHAT_OPTS,
    ),
    BadCase(
        "messages field absent",
        "a.jsonl",
        jsonl({"text": "x"}),
        "bad_template",
        ":1",
        "non-empty list of messages, got NoneType",
        opts=CHAT_OPTS,
    ),
    BadCase(
        "saved dataset with a malformed chat",
        "ds",
        save_hf({"messages": [MSGS, [{"role": "bot", "content": "x"}]]}),
        "bad_template",
        "/data-00000-of-00001.arrow:row 1",
        "message 0 has role 'bot'",
        kept=1,
        opts=CHAT_OPTS,
    ),
    BadCase("empty jsonl", "a.jsonl", b"", "empty_file", "", "no records"),
    BadCase("jsonl of blank lines", "a.jsonl", b"\n \n\t\n", "empty_file", "", "no records"),
    BadCase("empty jsonl.gz", "a.jsonl.gz", gzip.compress(b""), "empty_file", "", "no records"),
    BadCase("empty text file", "a.txt", b"", "empty_file", "", "no records"),
    BadCase("text of blank lines", "a.txt", b"\n\n", "empty_file", "", "no records", opts=LINES),
    BadCase(
        "parquet with no rows",
        "a.parquet",
        write_parquet(pa.table({"text": pa.array([], pa.string())})),
        "empty_file",
        "",
        "no records",
    ),
    BadCase("dangling link", "a.jsonl", _broken_link, "unreadable_file", "", "FileNotFoundError"),
    BadCase("not gzip", "a.jsonl.gz", b"plain bytes", "unreadable_file", "", "BadGzipFile"),
    BadCase(
        "gzip cut off mid-way",
        "a.jsonl.gz",
        _truncated(gzip.compress),
        "unreadable_file",
        "",
        "EOFError",
        kept=None,
    ),
    BadCase(
        "zstd cut off mid-way",
        "a.jsonl.zst",
        _truncated(lambda b: zstandard.ZstdCompressor().compress(b)),
        "unreadable_file",
        "",
        "truncated file",
        kept=None,
    ),
    BadCase("not zstd", "a.jsonl.zst", b"plain bytes", "unreadable_file", "", "ZstdError"),
    BadCase("not parquet", "a.parquet", b"plain bytes", "unreadable_file", "", "ArrowInvalid"),
    BadCase("not arrow", "a.arrow", b"plain bytes" * 10, "unreadable_file", "", "ArrowInvalid"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.name)
def test_bad_input_is_counted(tmp_path: Path, case: BadCase) -> None:
    put(tmp_path / "in" / case.filename, case.content)
    records, counts = drain(str(tmp_path / "in"), case.opts)
    assert counts.dropped == {case.reason: case.dropped}
    if case.kept is None:
        assert 0 < len(records) < 20_000
    else:
        assert len(records) == case.kept


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.name)
def test_bad_input_fails_in_strict_mode(tmp_path: Path, case: BadCase) -> None:
    put(tmp_path / "in" / case.filename, case.content)
    where = f"{tmp_path / 'in' / case.filename}{case.where}"
    head = re.escape(f"{where}: {case.reason.replace('_', ' ')}: ")
    strict = SourceOptions(**{**vars(case.opts), "on_error": "fail"})
    with pytest.raises(DataError, match=f"^{head}.*{re.escape(case.detail)}"):
        drain(str(tmp_path / "in"), strict)


# --- source errors: configuration, never counted -------------------------------------------------


@dataclass(frozen=True)
class SourceErrorCase:
    name: str
    files: dict[str, bytes]
    source: str  # "{d}" is the test's directory
    error: str


SOURCE_ERROR_CASES = [
    SourceErrorCase("no such file", {}, "{d}/missing.jsonl", "'{d}/missing.jsonl' matches no file"),
    SourceErrorCase("glob matches nothing", {}, "{d}/*.jsonl", "'{d}/*.jsonl' matches no file"),
    SourceErrorCase("empty directory", {}, "{d}", "'{d}' matches no file"),
    SourceErrorCase(
        "one comma part matches nothing",
        {"a.jsonl": b"{}"},
        "{d}/a.jsonl,{d}/b/*.parquet",
        "'{d}/b/*.parquet' matches no file",
    ),
    SourceErrorCase("empty source", {}, " , ", "data source is empty"),
    SourceErrorCase(
        "unknown extension, before any record is read",
        {"a.jsonl": b'{"text": "x"}\n', "README.md": b"# hi"},
        "{d}",
        "{d}/README.md: cannot tell the format from the name; allowed: .jsonl",
    ),
    SourceErrorCase(
        "compressed parquet",
        {"a.parquet.gz": b""},
        "{d}",
        "{d}/a.parquet.gz: gzip-compressed parquet is not supported",
    ),
]


@pytest.mark.parametrize("case", SOURCE_ERROR_CASES, ids=lambda c: c.name)
def test_source_errors(tmp_path: Path, case: SourceErrorCase) -> None:
    for name, data in case.files.items():
        put(tmp_path / name, data)
    source = case.source.format(d=tmp_path)
    counts = Counts()
    with pytest.raises(DataError, match=re.escape(case.error.format(d=tmp_path))):
        list(read_records(source, SourceOptions(on_error="skip"), counts))
    assert counts.read == 0


# --- streaming -----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_jsonl_streams_in_bounded_memory(tmp_path: Path, suffix: str) -> None:
    """200k lines (27 MB; ~100 MB as Python objects) read with a peak far below the file.

    The zstd case compresses ~90x, the hard case for a decoder with no output limit.
    """
    path = tmp_path / f"big{suffix}"
    line = b'{"text": "document %d ' + b"lorem ipsum dolor sit amet " * 4 + b'"}\n'
    raw_size = 0
    with open(path, "wb") as fh, ExitStack() as stack:
        out: Any = fh
        if suffix.endswith(".zst"):
            out = stack.enter_context(zstandard.ZstdCompressor(level=1).stream_writer(fh))
        for start in range(0, 200_000, 10_000):
            chunk = b"".join(line % i for i in range(start, start + 10_000))
            raw_size += len(chunk)
            out.write(chunk)
    counts = Counts()
    kept = 0
    tracemalloc.start()
    try:
        for rec in read_records(str(path), DEFAULT, counts):
            kept += rec.text.startswith("document ")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept == counts.read == 200_000
    assert peak < raw_size / 10, f"peak {peak} bytes for a {raw_size}-byte file"
