"""Read training records from local paths, globs, directories or any fsspec URI, streaming.

Why this shape: prepare_data must take a few hundred GB from object storage as readily as a
file on a laptop, so every format is read as a stream (JSONL and text line by line, Parquet and
Arrow batch by batch) and memory stays bounded by one batch or one line, whatever the input
size. Every record read is counted once in `counts.read`; a record that cannot become text is
dropped under a reason (or, with `on_error="fail"`, stops the stage naming file and line), so
the caller's `read = kept + sum(dropped)` always reconciles and nothing disappears silently.

Sources, comma-separated when there are several:

    synthetic                         the built-in arithmetic task (kubellm.data.synthetic)
    data/train.jsonl                  a file
    'data/*.jsonl.zst'                a glob (also inside URIs: 's3://bucket/c4/*.jsonl.gz')
    data/corpus/                      a directory: every file under it, recursively, sorted
    s3://..., gs://..., abfs://..., memory://x.parquet  an object store (s3fs, gcsfs, adlfs)
    https://..., hf://datasets/...    only with allow_http_sources=true (kubellm.data.access)

Formats by extension (or forced with `SourceOptions.format`): .jsonl/.json/.ndjson (optionally
.gz or .zst), .parquet, .txt (optionally .gz or .zst; a document per file or per line), and a
Hugging Face `save_to_disk` directory (its .arrow files, in the order its state.json lists).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq
import zstandard

from kubellm.config import DataFormat, OnError, Template, TextMode
from kubellm.data.access import check_local, check_source, open_filesystem
from kubellm.data.records import Counts, DataError, Record, TextBatch
from kubellm.data.synthetic import arithmetic_records
from kubellm.data.templates import ChatFormat, Segment, check_messages, prompt_response_messages

Format = Literal["jsonl", "parquet", "text", "hf"]

SYNTHETIC = "synthetic"
# Rows per Parquet/Arrow batch: large enough to amortize the Python per-batch cost, small
# enough that a batch of long documents stays in the tens of MB.
BATCH_ROWS = 1024
# Compressed bytes fed to the zstd decoder per step. The decoder has no output limit, so this
# bounds each decoded piece: text compresses 4-10x (tens of KB), repetitive data 100x (~1 MB).
# Measured: 8 KiB steps decode as fast as 256 KiB ones.
_ZSTD_STEP = 1 << 13
# Plain-text JSONL is parsed this many lines (or bytes) at a time by Arrow's JSON reader,
# and line by line only where a batch has a line Arrow and Python might read differently.
_JSONL_LINES = 1024
_JSONL_BYTES = 1 << 20

_FORMATS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".txt": "text",
    ".arrow": "hf",
}
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_ALLOWED = ".jsonl, .json, .ndjson (also .gz, .zst), .parquet, .txt (also .gz, .zst), .arrow"
# Files `datasets.save_to_disk` writes beside the data; metadata, never records.
_HF_META = frozenset({"state.json", "dataset_info.json", "dataset_dict.json"})
_GLOB_CHARS = re.compile(r"[*?\[]")
# What a failing file raises: OS errors (missing, permission, network), truncated or corrupt
# compression, and Arrow's "this is not a Parquet/Arrow file".
_READ_ERRORS = (OSError, EOFError, zstandard.ZstdError, pa.ArrowException)


@dataclass(frozen=True)
class SourceOptions:
    """How to read a source and turn its rows into records (config maps onto these fields)."""

    format: DataFormat = "auto"
    text_field: str = "text"
    text_mode: TextMode = "file"  # plain text: a document per file, or per line
    template: Template = "none"
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    # templated records are rendered in this format (the tokenizer's chat template, see
    # kubellm.data.templates); None: the default format with the byte-level BPE's EOS
    chat: ChatFormat | None = None
    on_error: OnError = "skip"
    allow_http: bool = False  # http(s):// and hf:// sources (kubellm.data.access)
    num_records: int = 20000  # synthetic only
    seed: int = 0  # synthetic only


class _Stream(Protocol):
    """What the readers need of a byte stream: fsspec files, GzipFile and BufferedReader."""

    def read(self, size: int = -1, /) -> bytes: ...
    def __iter__(self) -> Iterator[bytes]: ...


@dataclass(frozen=True)
class _File:
    fs: Any  # fsspec.AbstractFileSystem
    path: str  # the filesystem's own path, for fs.open
    name: str  # what users see in errors and the file list: their URI form or a local path


def source_files(source: str, allow_http: bool = False) -> list[str]:
    """The files `source` resolves to, in reading order (for the fingerprint and for errors).

    `synthetic` contributes no file. Raises DataError for a part that matches no file, or
    names what a source may not (kubellm.data.access; http(s) and hf only with allow_http).
    """
    parts = [p for p in _parts(source) if p != SYNTHETIC]
    return [f.name for part in parts for f in _resolve(part, allow_http)]


# What a filesystem's `info` says about a file's version: size plus whichever of these it
# has (local: mtime; S3: ETag/LastModified; GCS: md5Hash/generation/updated; HF: last_commit).
_VERSION_KEYS = (
    "size",
    "mtime",
    "ETag",
    "etag",
    "LastModified",
    "last_modified",
    "md5Hash",
    "generation",
    "updated",
    "last_commit",
    "blob_id",
)


def check_parts(source: str, allow_http: bool = False) -> None:
    """Refuse, before anything is listed or read, a part of `source` that names what a
    source may not (kubellm.data.access); what the parts resolve to is checked again when
    they are resolved."""
    for part in _parts(source):
        if part != SYNTHETIC:
            check_source(part, "data_source", allow_http)


def source_stamp(source: str, allow_http: bool = False) -> list[dict[str, str]]:
    """Every file of `source` with its version as its filesystem reports it (size and
    mtime, ETag or generation), without reading any data: cheap enough for preflight, and
    different as soon as a file is replaced, grown or added under the same URI. This is what
    lets a pipeline cache prepare_data by its parameters and still notice new data.

    Raises DataError for a part that matches no file, as reading would.
    """
    stamp = []
    for part in _parts(source):
        if part == SYNTHETIC:
            stamp.append({"file": SYNTHETIC})
            continue
        for f in _resolve(part, allow_http):
            info = f.fs.info(f.path)
            version = {k: str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None}
            stamp.append({"file": f.name, **version})
    return stamp


def read_records(source: str, opts: SourceOptions, counts: Counts) -> Iterator[Record]:
    """Stream the records of `source`, counting each in `counts.read` and every drop by reason.

    The whole source is resolved and every file's format checked before the first record is
    read, so a typo or a stray README fails in a second, not after hours of reading.
    """
    for item in read_batches(source, opts, counts):
        if isinstance(item, TextBatch):
            yield from item.records()
        else:
            yield item


def read_batches(source: str, opts: SourceOptions, counts: Counts) -> Iterator[Record | TextBatch]:
    """`read_records`, with runs of plain-text JSONL records as one `TextBatch` each (the
    same records, counted the same way, in the same order)."""
    plan: list[tuple[_File, Format, str | None] | None] = []  # None stands for synthetic
    for part in _parts(source):
        if part == SYNTHETIC:
            plan.append(None)
            continue
        plan += [(f, *_format_of(f, opts.format)) for f in _resolve(part, opts.allow_http)]
    for item in plan:
        if item is None:
            yield from _synthetic(opts, counts)
        else:
            yield from _read_file(*item, opts, counts)


# --- resolving sources to files ---------------------------------------------------------------


def _parts(source: str) -> list[str]:
    parts = [p.strip() for p in source.split(",") if p.strip()]
    if not parts:
        raise DataError("data source is empty: give a path, glob, URI or 'synthetic'")
    return parts


def _resolve(part: str, allow_http: bool = False) -> list[_File]:
    """Files of one source part: a file, a glob, or a directory walked recursively; the part
    and every local file it finds checked against what a source may name (access.py)."""
    local = check_source(part, "data_source", allow_http) is None
    fs, path = open_filesystem(part, "data_source")
    uri = "://" in part or "::" in part
    relative = not uri and not os.path.isabs(part)

    def name(p: str) -> str:
        """The file as the user would write it: a URI stays a URI, a relative path relative."""
        if uri:
            return str(fs.unstrip_protocol(p))
        return os.path.relpath(p) if relative else p

    paths: list[str] = []
    if _GLOB_CHARS.search(path):
        # detail=True: the listing says which hits are directories, without a call per file
        for hit, info in sorted(fs.glob(path, detail=True).items()):
            paths += _walk(fs, hit) if info.get("type") == "directory" else [hit]
    elif fs.isdir(path):
        paths = _walk(fs, path)
    elif fs.exists(path):
        paths = [path]
    paths = list(dict.fromkeys(paths))
    if not paths:
        raise DataError(f"data source {part!r} matches no file")
    if local:
        for p in paths:  # a link in a data folder may point anywhere
            check_local(p, "data_source")
    return [_File(fs, p, name(p)) for p in paths]


def _walk(fs: Any, root: str) -> list[str]:
    """Every data file under `root`, sorted, the way Arrow and Spark datasets are laid out.

    Skipped, because they are never records: names starting with "." or "_" (`_SUCCESS`,
    `.crc`, `_temporary/`), and in a `save_to_disk` directory everything but the .arrow files
    its state.json lists (metadata, and cache files `datasets` leaves beside them).
    """
    root = root.rstrip("/")
    files = sorted(
        p
        for p in fs.find(root)
        if not any(c[:1] in "._" for c in posixpath.relpath(p, root or "/").split("/"))
    )
    by_dir: dict[str, list[str]] = {}
    for p in files:
        by_dir.setdefault(posixpath.dirname(p), []).append(p)
    out: list[str] = []
    for d, names in by_dir.items():
        state = posixpath.join(d, "state.json")
        if state in names:
            out += _hf_data_files(fs, d, state, names)
        else:
            out += [p for p in names if posixpath.basename(p) != "dataset_dict.json"]
    return sorted(out)


def _hf_data_files(fs: Any, d: str, state: str, names: list[str]) -> list[str]:
    """The .arrow files of a saved dataset, in its own order; all .arrow files if unreadable."""
    arrows = [p for p in names if p.endswith(".arrow")]
    try:
        with fs.open(state, "rb") as fh:
            listed = [posixpath.join(d, f["filename"]) for f in json.load(fh)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return arrows
    return listed if all(p in names for p in listed) else arrows


def _format_of(f: _File, forced: DataFormat) -> tuple[Format, str | None]:
    """(format, compression) from the file name, or the forced format; DataError if unknown."""
    base = posixpath.basename(f.path).lower()
    stem, ext = posixpath.splitext(base)
    compression = _COMPRESSIONS.get(ext)
    if compression:
        ext = posixpath.splitext(stem)[1]
    fmt: Format | None = _FORMATS.get(ext) if forced == "auto" else forced
    if fmt is None:
        raise DataError(
            f"{f.name}: cannot tell the format from the name; allowed: {_ALLOWED}, or set "
            "format to one of jsonl, parquet, text, hf (a saved Hugging Face dataset)"
        )
    if compression and fmt in ("parquet", "hf"):
        raise DataError(f"{f.name}: {compression}-compressed {fmt} is not supported")
    return fmt, compression


# --- reading -------------------------------------------------------------------------------


def _synthetic(opts: SourceOptions, counts: Counts) -> Iterator[Record]:
    for i, r in enumerate(arithmetic_records(opts.num_records, seed=opts.seed), start=1):
        counts.read += 1
        yield Record(r["text"], f"{SYNTHETIC}:{i}", r["prompt"], r["completion"])


def _read_file(
    f: _File, fmt: Format, compression: str | None, opts: SourceOptions, counts: Counts
) -> Iterator[Record | TextBatch]:
    """One file's records; a file that fails to open or read counts as one unreadable unit.

    Records yielded before a read error stay counted and kept: the error is reported where it
    happened, and the rest of the file is lost under `unreadable_file`.
    """
    units = 0
    tally = [0]  # rows _jsonl_records read (it counts them itself)
    try:
        with ExitStack() as stack:
            raw: Any = stack.enter_context(f.fs.open(f.path, "rb"))  # fsspec files are untyped
            if fmt == "parquet":
                rows = _parquet_rows(f, raw, opts)
            elif fmt == "hf":
                rows = _arrow_rows(f, raw, opts)
            else:
                stream = _decompress(raw, compression, stack)
                if fmt == "jsonl" and opts.template == "none":  # counts its own rows
                    yield from _jsonl_records(f, stream, opts, counts, tally)
                    rows = iter(())
                else:
                    rows = _jsonl_rows(f, stream) if fmt == "jsonl" else _text_rows(f, stream, opts)
            for where, row in rows:
                units += 1
                counts.read += 1
                rec = _to_record(row, where, opts, counts)
                if rec is not None:
                    yield rec
    except DataError:
        raise
    except _READ_ERRORS as err:
        units += tally[0]
        counts.read += 1
        after = f" (after {units} records)" if units else ""
        counts.drop("unreadable_file", f.name, opts.on_error, f"{type(err).__name__}: {err}{after}")
        return
    units += tally[0]
    if units == 0:
        counts.read += 1
        counts.drop("empty_file", f.name, opts.on_error, "no records in the file")


# A row is a mapping of fields, or a _Bad telling why the line could not become one.
@dataclass(frozen=True)
class _Bad:
    reason: str  # "" for a line that is not an object: missing_text, or bad_template if templated
    detail: str


Row = Mapping[str, Any] | _Bad


def _jsonl_rows(f: _File, stream: Iterable[bytes], start: int = 1) -> Iterator[tuple[str, Row]]:
    """One row per non-blank line; a line is decoded alone, so one bad line costs one record.

    `start`: the number of the stream's first line in the file.
    """
    for lineno, raw in enumerate(stream, start=start):
        if raw.isspace():  # blank (the same bytes as `not raw.strip()`, without the copy)
            continue
        where = f"{f.name}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield where, _Bad("invalid_utf8", str(err))
            continue
        if lineno == 1:
            line = line.removeprefix("\ufeff")  # a BOM some editors write
        try:
            obj = _loads(line)
        except json.JSONDecodeError as err:
            yield where, _Bad("malformed_json", str(err))
            continue
        if not isinstance(obj, dict):
            yield where, _Bad("", f"the line is a JSON {type(obj).__name__}, not an object")
            continue
        yield where, obj


_DECODER = json.JSONDecoder()


def _loads(line: str) -> Any:
    """`json.loads(line)`, with a shortcut for the usual line: an object, then a newline.

    The shortcut skips json.loads' argument checks and whitespace regexes (a tenth of the
    parse time of a short line); anything else, errors included, goes through json.loads.
    """
    if line[:1] == "{":
        try:
            obj, end = _DECODER.raw_decode(line)
        except json.JSONDecodeError:
            pass
        else:
            if not line[end:].strip(" \t\n\r"):  # JSON's whitespace, nothing else after
                return obj
    return json.loads(line)


def _jsonl_records(
    f: _File, stream: _Stream, opts: SourceOptions, counts: Counts, tally: list[int]
) -> Iterator[Record | TextBatch]:
    """Plain-text JSONL (template "none"): the records `_jsonl_rows` + `_to_record` make,
    counted the same way (`tally[0]`: rows read), with the usual lines parsed in batches.

    Short records (instruction data) spend more time in Python's JSON decoder, the per-row
    dicts and the per-row calls than in the tokenizer; Arrow's reader parses a batch in C++
    and only the wanted fields become Python strings. A line that is not the usual shape
    (one object from "{" to "}" and a newline, valid UTF-8) goes through `_jsonl_rows` on
    its own, in its place; lines read before a read error still become records.
    """
    chunk: list[bytes] = []  # lines read, not yet sorted into batches
    size = lineno = 0  # lineno: lines before the chunk
    try:
        for raw in stream:
            chunk.append(raw)
            size += len(raw)
            if len(chunk) >= _JSONL_LINES or size >= _JSONL_BYTES:
                lines, chunk, size = chunk, [], 0
                yield from _jsonl_chunk(f, lines, lineno, opts, counts, tally)
                lineno += len(lines)
    except _READ_ERRORS:
        yield from _jsonl_chunk(f, chunk, lineno, opts, counts, tally)
        raise
    yield from _jsonl_chunk(f, chunk, lineno, opts, counts, tally)


def _jsonl_chunk(
    f: _File, chunk: list[bytes], before: int, opts: SourceOptions, counts: Counts, tally: list[int]
) -> Iterator[Record | TextBatch]:
    """The records of consecutive lines `before + 1`...: each run of usual lines (one object
    from "{" to "}\\n", valid UTF-8) is one Arrow batch, every other line goes through
    `_jsonl_rows` on its own, in its place. The batches do not change the records
    (`_jsonl_batch` reads a batch as the lines would be read one by one), only how fast
    they come."""
    unusual = [
        i
        for i, raw in enumerate(chunk)
        if not (raw.endswith(b"}\n") and raw.startswith(b"{") and (raw.isascii() or _utf8(raw)))
    ]
    if not unusual:  # the common case: one batch
        yield from _jsonl_batch(f, chunk, before + 1, opts, counts, tally)
        return
    start = 0
    for i in [*unusual, len(chunk)]:
        yield from _jsonl_batch(f, chunk[start:i], before + 1 + start, opts, counts, tally)
        if i < len(chunk):
            yield from _jsonl_lines(f, [chunk[i]], before + 1 + i, opts, counts, tally)
        start = i + 1


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _jsonl_lines(
    f: _File, lines: list[bytes], first: int, opts: SourceOptions, counts: Counts, tally: list[int]
) -> Iterator[Record]:
    """Lines `first`... read one by one, as `_read_file` reads any JSONL file."""
    for where, row in _jsonl_rows(f, lines, first):
        tally[0] += 1
        counts.read += 1
        rec = _to_record(row, where, opts, counts)
        if rec is not None:
            yield rec


def _jsonl_batch(
    f: _File, lines: list[bytes], first: int, opts: SourceOptions, counts: Counts, tally: list[int]
) -> Iterator[Record | TextBatch]:
    """The records of `lines` (usual lines, line `first` on): parsed by Arrow if it can.
    Plain text comes as TextBatches: each run of lines with a text is one."""
    if not lines:
        return
    columns = _parse_batch(lines, opts)
    if columns is None:  # something Arrow refuses (a number as text...): one by one
        yield from _jsonl_lines(f, lines, first, opts, counts, tally)
        return
    texts, prompts, completions, column = columns
    name, on_error, field = f.name, opts.on_error, opts.text_field
    tally[0] += len(texts)
    counts.read += len(texts)
    # Arrow's strings are valid UTF-8 (no lone surrogates): _to_record's check cannot fire
    if prompts is None or completions is None:  # no pairs in the batch: plain text
        # the lines without a text are dropped in their place, between the batches
        missing = [i for i, t in enumerate(texts) if t is None] if column.null_count else []
        start = 0
        for i in [*missing, len(texts)]:
            if i > start:
                run = range(first + start, first + i)
                yield TextBatch(texts[start:i], column.slice(start, i - start), name, run)
            if i < len(texts):
                where = f"{name}:{first + i}"
                counts.drop("missing_text", where, on_error, _not_string(field, None))
            start = i + 1
        return
    for lineno, text, prompt, completion in zip(
        range(first, first + len(texts)), texts, prompts, completions, strict=True
    ):
        if text is None:
            where = f"{name}:{lineno}"
            counts.drop("missing_text", where, on_error, _not_string(field, None))
            continue
        if prompt is None or completion is None:
            prompt = completion = None
        yield Record(text, f"{name}:{lineno}", prompt, completion)


_BATCH_PARSE: dict[tuple[str, ...], pj.ParseOptions] = {}


def _parse_batch(
    lines: list[bytes], opts: SourceOptions
) -> tuple[list[Any], list[Any] | None, list[Any] | None, pa.Array] | None:
    """(texts, prompts, completions, the texts' Arrow array) of usual JSONL lines, or None
    to read them one by one.

    Each line is one object from "{" to "}\\n" and valid UTF-8 (Arrow does not check the
    fields it skips). Arrow is trusted where it reads the batch without error (it refuses
    lone surrogates, control characters in strings, a wanted key twice, trailing data, and
    a number, list or object where a wanted field is) into one row per line: then each
    wanted field is what Python's json gives, a string or None. None for prompts or
    completions: that field is null throughout.
    """
    block = b"".join(lines)
    if b"-NaN" in block:  # Arrow reads it as a number, Python's json refuses it
        return None
    wanted = tuple(dict.fromkeys((opts.text_field, "prompt", "completion")))
    parse = _BATCH_PARSE.get(wanted)
    if parse is None:
        schema = pa.schema([(c, pa.string()) for c in wanted])
        parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
        _BATCH_PARSE[wanted] = parse
    read = pj.ReadOptions(use_threads=False, block_size=len(block) + 1)
    try:
        table = pj.read_json(pa.BufferReader(block), read_options=read, parse_options=parse)
    except pa.ArrowException:
        return None
    if table.num_rows != len(lines):
        return None

    def column(name: str) -> list[Any] | None:
        col = table.column(name)
        return None if col.null_count == len(col) else col.to_pylist()

    chunks = table.column(opts.text_field).chunks
    text_column = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks)
    completions = column("completion")
    # no completions: the prompts are never read (the records are plain text)
    prompts = column("prompt") if completions is not None else None
    return text_column.to_pylist(), prompts, completions, text_column


def _text_rows(f: _File, stream: _Stream, opts: SourceOptions) -> Iterator[tuple[str, Row]]:
    """A document per file (the whole file) or per non-blank line, under `text_field`."""
    if opts.text_mode == "file":
        data = stream.read()
        if not data:
            return
        try:
            yield f.name, {opts.text_field: data.decode("utf-8").removeprefix("\ufeff")}
        except UnicodeDecodeError as err:
            yield f.name, _Bad("invalid_utf8", str(err))
        return
    for lineno, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        where = f"{f.name}:{lineno}"
        try:
            line = raw.rstrip(b"\r\n").decode("utf-8")
        except UnicodeDecodeError as err:
            yield where, _Bad("invalid_utf8", str(err))
            continue
        yield where, {opts.text_field: line.removeprefix("\ufeff") if lineno == 1 else line}


def _parquet_rows(f: _File, raw: Any, opts: SourceOptions) -> Iterator[tuple[str, Row]]:
    """Rows read a batch at a time, only the columns the options need."""
    pf = pq.ParquetFile(raw)
    names = set(pf.schema_arrow.names)
    columns = [c for c in _wanted_columns(opts) if c in names]
    if not columns:  # none of the wanted fields exist: every row is counted as missing them
        for n in range(pf.metadata.num_rows):
            yield f"{f.name}:row {n}", {}
        return
    batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=columns)
    yield from _batch_rows(f, batches, columns)


def _arrow_rows(f: _File, raw: Any, opts: SourceOptions) -> Iterator[tuple[str, Row]]:
    """Rows of an Arrow IPC file (`datasets` writes the stream format; Feather v2 also works)."""
    magic = raw.read(6)
    raw.seek(0)
    if magic == b"ARROW1":
        reader = pa.ipc.open_file(raw)
        batches: Iterable[pa.RecordBatch] = (
            reader.get_batch(i) for i in range(reader.num_record_batches)
        )
        schema = reader.schema
    else:
        stream = pa.ipc.open_stream(raw)
        batches, schema = stream, stream.schema
    columns = [c for c in _wanted_columns(opts) if c in set(schema.names)]
    yield from _batch_rows(f, batches, columns)


def _batch_rows(
    f: _File, batches: Iterable[pa.RecordBatch], columns: list[str]
) -> Iterator[tuple[str, Row]]:
    n = 0
    for batch in batches:
        values = [batch.column(c).to_pylist() for c in columns]
        for i in range(batch.num_rows):
            yield f"{f.name}:row {n}", {c: v[i] for c, v in zip(columns, values, strict=True)}
            n += 1


def _wanted_columns(opts: SourceOptions) -> list[str]:
    if opts.template == "prompt_response":
        wanted = [opts.prompt_field, opts.response_field]
    elif opts.template == "messages":
        wanted = [opts.messages_field]
    else:
        wanted = [opts.text_field, "prompt", "completion"]
    return list(dict.fromkeys(wanted))


def _to_record(row: Row, where: str, opts: SourceOptions, counts: Counts) -> Record | None:
    """The record a row makes under the options, or None after counting why it cannot."""
    if isinstance(row, _Bad):
        reason = row.reason or ("missing_text" if opts.template == "none" else "bad_template")
        counts.drop(reason, where, opts.on_error, row.detail)
        return None
    prompt: Any
    completion: Any
    if opts.template == "none":
        text = row.get(opts.text_field)
        if not isinstance(text, str):
            counts.drop("missing_text", where, opts.on_error, _not_string(opts.text_field, text))
            return None
        prompt, completion = row.get("prompt"), row.get("completion")
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            prompt = completion = None
    else:
        try:
            segments, messages = _render(row, opts)
        except ValueError as err:
            counts.drop("bad_template", where, opts.on_error, str(err))
            return None
        text = "".join([s for s, _ in segments])
        # prompt/completion: split where the last trained piece starts
        cut = len(text)
        for i in range(len(segments) - 1, -1, -1):
            if segments[i][1]:
                cut -= sum([len(s) for s, _ in segments[i:]])
                break
        prompt, completion = text[:cut], text[cut:]
    # JSON "\ud800" escapes decode to lone surrogates, which cannot be encoded to UTF-8 and
    # would fail the tokenizer far from here; count them where the input is.
    for s in (text, prompt, completion):
        if s is not None and not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as err:
                counts.drop("invalid_utf8", where, opts.on_error, f"lone surrogate: {err}")
                return None
    if opts.template != "none":
        return Record(text, where, prompt, completion, segments, messages)
    return Record(text, where, prompt, completion)


def _render(
    row: Mapping[str, Any], opts: SourceOptions
) -> tuple[tuple[Segment, ...], list[dict[str, str]]]:
    """(segments, messages) under the template; ValueError says what is wrong with the row.
    A prompt/response pair is a user message and the assistant's answer."""
    if opts.template == "messages":
        messages = check_messages(row.get(opts.messages_field))
    else:
        prompt, response = row.get(opts.prompt_field), row.get(opts.response_field)
        if not isinstance(prompt, str):
            raise ValueError(_not_string(opts.prompt_field, prompt))
        if not isinstance(response, str):
            raise ValueError(_not_string(opts.response_field, response))
        messages = prompt_response_messages(prompt, response)
    return (opts.chat or _default_chat()).checked_segments(messages), messages


_DEFAULT_CHAT: list[ChatFormat] = []


def _default_chat() -> ChatFormat:
    """The default chat format with the byte-level BPE's special tokens (built once)."""
    if not _DEFAULT_CHAT:
        from kubellm.data.tokenizer import EOS, PAD

        _DEFAULT_CHAT.append(
            ChatFormat(special_tokens={"bos_token": EOS, "eos_token": EOS, "pad_token": PAD})
        )
    return _DEFAULT_CHAT[0]


def _not_string(name: str, value: Any) -> str:
    if value is None:
        return f"field {name!r} is missing"
    return f"field {name!r} is {type(value).__name__}, not a string"


# --- decompression -------------------------------------------------------------------------


def _decompress(raw: Any, compression: str | None, stack: ExitStack) -> _Stream:
    """A buffered byte stream of the decoded file, read lazily (never the whole file)."""
    if compression == "gzip":
        gz = gzip.GzipFile(fileobj=raw, mode="rb")
        stack.callback(gz.close)
        return gz
    if compression == "zstd":
        zst = io.BufferedReader(_ZstdReader(raw), 1 << 16)
        stack.callback(zst.close)
        return zst
    return raw


class _ZstdReader(io.RawIOBase):
    """Streaming zstd decoding that, unlike zstandard's stream_reader, reports truncation.

    zstandard's stream_reader returns a cut-off file's prefix as if it were the whole file,
    which would drop the rest of a truncated upload silently. Here a stream that ends inside a
    frame raises EOFError (as gzip does), and concatenated frames (`zstd -c a >> f`) are read
    through.
    """

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            data = self._raw.read(_ZSTD_STEP)
            if not data:
                if self._in_frame:
                    raise EOFError("zstd stream ended inside a frame (truncated file)")
                return 0
            self._buf = memoryview(self._feed(data))
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]  # a view: no copy of the rest of the chunk
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._obj.decompress(data))
            self._in_frame = not self._obj.eof
            if self._in_frame:
                break
            data = self._obj.unused_data
            self._obj = self._dctx.decompressobj()
        return b"".join(out)
