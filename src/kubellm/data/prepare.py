"""prepare_data: read, clean, dedup, split, tokenize, pack and shard text to Parquet.

Streaming from end to end: records arrive in batches from the source readers, are cleaned
and deduplicated in this thread while the previous batch is tokenized (the fast tokenizer
releases the GIL and uses every core) and packed and written in a worker thread; memory
holds a few batches, the dedup digests (16 bytes a document) and one open shard per split.

The Dataset artifact it writes is the contract with every later stage:

    train/shard-00000.parquet   input_ids: list<int32> (one packed row each), loss_mask: list<int8>
    val/shard-00000.parquet     the same for held-out records
    eval/examples.parquet       prompt, completion (held-out records that have them)
    tokenizer/                  Hugging Face tokenizer files
    manifest.json               counts (read = kept + dropped), tokens, shards, fingerprint

Nothing is dropped silently: each dropped record is counted under its reason.

    kubellm prepare runs/dataset --set data_source='corpus/*.jsonl.zst'
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import string
import sys
import time
import unicodedata
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kubellm.config import ChatLoss, DataFormat, OnError, Packing, Template, TextMode
from kubellm.data.access import check_local
from kubellm.data.artifact import MANIFEST, data_fingerprint
from kubellm.data.minhash import NearDuplicates
from kubellm.data.packing import (
    BestFitPacker,
    ConcatPacker,
    Doc,
    PackStats,
    Rows,
    concat_rows,
    is_masked,
    make_packer,
)
from kubellm.data.records import Counts, DataError, Record, TextBatch
from kubellm.data.sources import (
    SourceOptions,
    check_parts,
    read_batches,
    read_records,
    source_files,
)
from kubellm.data.templates import DEFAULT_CHAT_TEMPLATE, ChatFormat
from kubellm.data.tokenizer import EOS, PAD, load_tokenizer, train_bpe

__all__ = ["DataError", "PrepareParams", "is_validation", "prepare"]

MAX_LISTED_FILES = 1000  # in the manifest; the count is always complete
MAX_EXAMPLES = 10_000  # held-out prompt/completion pairs kept for task metrics
# A tokenizer batch ends at `batch_records` records or at this many characters, whichever
# comes first: long documents make small batches, so tokenizing starts early, overlaps
# reading and cleaning, and memory holds a few batches, not a few thousand long documents.
# On the benchmark's messy corpus 1 Mi and 256 Ki characters were slower (more tokenizer
# calls, each a GIL hand-off), 4 Mi no faster.
_BATCH_CHARS = 1 << 21
_MAX_INFLIGHT = 3  # batches cleaned but not yet packed and written
_FINGERPRINT_BATCH = 1024  # records' raw texts hashed into the source fingerprint at a time
_blake2b = hashlib.blake2b
_NOT_SYMBOL_BYTES = (string.ascii_letters + string.digits + string.whitespace).encode() + bytes(
    range(128, 256)
)
_FOLDING = "  |[\t\r\f\v]| \n|\n "  # RE2: a match where `_needs_folding` is true


@dataclass
class PrepareParams:
    source: str = "synthetic"
    format: DataFormat = "auto"
    text_field: str = "text"
    text_mode: TextMode = "file"  # plain text: a document per file or per line
    template: Template = "none"
    chat_loss: ChatLoss = "all_assistant"  # chats: every assistant turn trained, or the last
    mask_prompt: bool = True  # prompt/completion records: loss on the completion only
    tokenizer: str = ""  # a tokenizer directory or hub name; "" trains a byte-level BPE
    trust_remote_code: bool = False
    tokenizer_sample: int = 200_000  # training records the BPE learns from
    num_records: int = 20000  # synthetic only
    seed: int = 0
    val_fraction: float = 0.1
    vocab_size: int = 512
    seq_len: int = 32
    packing: Packing = "concat"
    min_chars: int = 1
    max_chars: int = 100_000
    max_symbol_ratio: float = 0.5  # share of characters that are neither letters, digits nor space
    max_repeated_line_ratio: float = 0.5  # share of non-empty lines that repeat an earlier one
    near_dedup: bool = False
    near_dedup_threshold: float = 0.8
    shard_rows: int = 65_536
    batch_records: int = 1024
    on_error: OnError = "skip"
    allow_http: bool = False  # http(s):// and hf:// sources (kubellm.data.access)
    progress_s: float = 10.0

    def source_options(self, chat: ChatFormat | None = None) -> SourceOptions:
        """How to read the source; templated records are rendered in `chat` (None: the
        default chat format, which the byte-level BPE this data trains is saved with)."""
        return SourceOptions(
            format=self.format,
            text_field=self.text_field,
            text_mode=self.text_mode,
            template=self.template,
            on_error=self.on_error,
            allow_http=self.allow_http,
            num_records=self.num_records,
            seed=self.seed,
            chat=chat if chat is not None or self.template == "none" else self.default_chat(),
        )

    def default_chat(self) -> ChatFormat:
        """The default chat format with the byte-level BPE's special tokens."""
        special = {"bos_token": EOS, "eos_token": EOS, "pad_token": PAD}
        return ChatFormat(DEFAULT_CHAT_TEMPLATE, special, self.chat_loss)


def normalize(text: str) -> str:
    """Unicode NFC, runs of horizontal whitespace folded, lines stripped.

    In full (the contract the tests hold the fast paths to): NFC; then, if the text has a
    run of two spaces, a tab, CR, FF or VT, or a space next to a newline: with no LF, every
    run of [ \\t\\r\\f\\v] becomes one space; with an LF, the text is split into lines
    as `str.splitlines` splits, each line's runs of spaces and tabs become one space, each
    line is stripped and the lines are joined with LF. Last, the whole text is stripped.

    Only C-level str methods, one pass each, and no regex: on long, irregular documents a
    regex per line cost a tenth of prepare's CPU time. Lines are normalized to NFC one by
    one, and only those that are not ASCII: NFC never changes, moves or merges whitespace
    or line breaks (tests/data/test_normalize.py checks this over every code point), so
    NFC commutes with splitting, stripping and folding.
    """
    if not _needs_folding(text):  # the common case: C scans, no copies
        return _nfc(text).strip()
    if "\n" in text:
        # strip, then fold: the same as the other way round (a run at a line's edge goes
        # either way), and then only runs inside lines are left to fold
        lines: Iterable[str] = map(str.strip, text.splitlines())
        if not text.isascii():
            lines = (ln if ln.isascii() else unicodedata.normalize("NFC", ln) for ln in lines)
        text = "\n".join(lines)
        if "\t" in text:
            text = text.replace("\t", " ")
    else:
        text = _nfc(text)
        for ch in "\t\r\f\v":
            if ch in text:
                text = text.replace(ch, " ")
    while "  " in text:  # a run of n spaces takes about log2(n) passes
        text = text.replace("  ", " ")
    return text.strip()


def _nfc(text: str) -> str:
    """NFC. Text below U+0100 is NFC as it is (no combining marks, no singletons).

    `unicodedata.normalize` returns its input when its quick check passes, so it is not
    preceded by `is_normalized`, which scans too (and for text with combining marks
    normalizes it in full), only to repeat the work when the text needs it.
    """
    if text.isascii():
        return text
    try:
        text.encode("latin-1")  # at memcpy speed: every character below U+0100
    except UnicodeEncodeError:
        return unicodedata.normalize("NFC", text)
    return text


def _needs_folding(text: str) -> bool:
    """Anything `normalize` would change besides the outer strip (unrolled `in` scans)."""
    return (
        "  " in text
        or "\t" in text
        or "\r" in text
        or "\f" in text
        or "\v" in text
        or " \n" in text
        or "\n " in text
    )


def digest(text: str) -> bytes:
    """Content hash: exact dedup key, and (first 8 bytes) the train/val split."""
    return _digest(text.encode("utf-8", "surrogatepass"))


def _digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=16).digest()


def is_validation(text: str, val_fraction: float) -> bool:
    """Split by content hash: a record's side never changes when data is appended."""
    return _is_val(digest(text), val_fraction)


def _is_val(key: bytes, val_fraction: float) -> bool:
    return int.from_bytes(key[:8], "big") % 1_000_000 < val_fraction * 1_000_000


def symbol_ratio(text: str) -> float:
    """Share of characters that are ASCII punctuation or symbols (markup, boilerplate).

    Counted in C: the UTF-8 bytes minus ASCII letters, digits, whitespace and every
    non-ASCII byte. Non-ASCII characters count as plain (most are letters in some script);
    a per-character Python loop would cost more than tokenizing.
    """
    return _symbols(text.encode("utf-8", "surrogatepass")) / max(len(text), 1)


def _symbols(raw: bytes) -> int:
    return len(raw.translate(None, _NOT_SYMBOL_BYTES))


def repeated_line_ratio(text: str) -> float:
    """Share of non-empty lines that repeat an earlier one (0 with fewer than two)."""
    if "\n" not in text:
        return 0.0
    lines = text.split("\n")
    n = len(lines) - lines.count("")
    if n < 2:
        return 0.0
    distinct = set(lines)
    distinct.discard("")
    return 1.0 - len(distinct) / n


class _Cleaner:
    """Normalization, filters and dedup: decides which records are kept, counts the rest.

    The source fingerprint hashes every record's raw text in read order: the same input
    gives the same fingerprint whatever the filters, and any edit to a record changes it.
    """

    def __init__(self, p: PrepareParams, counts: Counts) -> None:
        self.p = p
        self.counts = counts
        self.seen: set[bytes] = set()
        self.near = NearDuplicates(p.near_dedup_threshold, seed=p.seed) if p.near_dedup else None
        self._fingerprint = hashlib.sha256()
        self._unhashed: list[bytes] = []  # raw texts not yet in the fingerprint, in order

    @property
    def fingerprint(self) -> Any:
        """The source fingerprint's hash (hashlib), every record so far in it.

        The same bytes as one update per record (its raw text, then NUL), hashed a batch at
        a time: two calls per record cost more than hashing a short record's bytes.
        """
        if self._unhashed:
            self._fingerprint.update(b"\0".join(self._unhashed))
            self._fingerprint.update(b"\0")
            self._unhashed.clear()
        return self._fingerprint

    def keep(self, rec: Record) -> tuple[Record, bool] | None:
        """The cleaned record and whether it is held out, or None when it is dropped."""
        p = self.p  # the reader has counted the record as read
        raw_in = rec.text.encode("utf-8", "surrogatepass")
        unhashed = self._unhashed
        unhashed.append(raw_in)
        if len(unhashed) >= _FINGERPRINT_BATCH:
            self.fingerprint  # noqa: B018  (hashes the batch)
        if rec.segments is not None:
            return self._keep_chat(rec)
        text = normalize(rec.text)
        # once, for the symbol count and the key (the raw bytes when normalizing changed nothing)
        raw = raw_in if text is rec.text else text.encode("utf-8", "surrogatepass")
        reason = self._filtered(text, raw)
        if reason is not None:
            self._drop(reason, text, rec.where)
            return None
        key = _blake2b(raw, digest_size=16).digest()  # = _digest(raw)
        if not self._unique(key, text, rec.where):
            return None
        if rec.prompt is None or rec.completion is None:  # plain text (not rec.is_pair)
            if text is not rec.text:
                rec = Record(text, rec.where, rec.prompt, rec.completion)
            return rec, _is_val(key, p.val_fraction)
        if rec.is_pair and rec.text != (rec.prompt or "") + (rec.completion or ""):
            rec = Record(rec.text, rec.where)  # fields that do not make up the text: plain text
        if rec.is_pair and text != rec.text:
            # keep the prompt/completion boundary exact: normalize the parts, not the whole
            prompt, completion = normalize(rec.prompt or ""), normalize(rec.completion or "")
            rec = Record(prompt + completion, rec.where, prompt, completion)
        else:
            rec = Record(text, rec.where, rec.prompt, rec.completion)
        return rec, _is_val(key, p.val_fraction)

    def keep_batch(self, batch: TextBatch) -> tuple[list[str], list[bool]]:
        """`keep` of each record of `batch`, in order: the kept texts, normalized, and
        whether each is held out. The same records, counts and fingerprint as `keep` one
        record at a time; the per-record work that can be done once per batch is."""
        p, counts = self.p, self.counts
        raws = [t.encode("utf-8", "surrogatepass") for t in batch.texts]
        self._unhashed.append(b"\0".join(raws))  # the same bytes as one item per record
        self.fingerprint  # noqa: B018  (hashes the batch)
        # `_needs_folding` of every text, as one regex pass in C++ over the batch
        folding = pc.match_substring_regex(batch.column, _FOLDING).to_pylist()
        texts: list[str] = []
        keys: list[bytes] = []
        for i, (orig, raw_in, fold) in enumerate(zip(batch.texts, raws, folding, strict=True)):
            # = normalize(orig), its folding test done above
            text = normalize(orig) if fold else (orig if orig.isascii() else _nfc(orig)).strip()
            raw = raw_in if text is orig else text.encode("utf-8", "surrogatepass")
            reason = self._filtered(text, raw)
            if reason is not None:
                self._drop(reason, text, batch.where(i))
                continue
            key = _blake2b(raw, digest_size=16).digest()  # = _digest(raw)
            seen_as = self._seen_as(key, text)
            if seen_as is not None:  # the where is made only for a drop
                counts.drop(seen_as, batch.where(i), "skip")
                continue
            texts.append(text)
            keys.append(key)
        counts.kept += len(texts)
        # = _is_val(key) of each key: its first 8 bytes as a big-endian integer
        first8 = np.frombuffer(b"".join(keys), dtype=">u8")[::2]
        held = first8 % 1_000_000 < p.val_fraction * 1_000_000
        return texts, held.tolist()

    def _filtered(self, text: str, raw: bytes) -> str | None:
        """Why a cleaned plain text (`raw`: its UTF-8) is dropped, or None: the filters."""
        p = self.p
        if not text:
            return "empty"
        if len(text) > p.max_chars:
            return "too_long"
        if len(text) < p.min_chars:
            return "too_short"
        if len(raw.translate(None, _NOT_SYMBOL_BYTES)) / max(len(text), 1) > p.max_symbol_ratio:
            return "symbol_ratio"
        if (
            "\n" in text
            # the ratio is at most 1 - 1/n for n non-empty lines, and n is at most this
            and 1.0 - 1.0 / (text.count("\n") + 1 - text.count("\n\n")) > p.max_repeated_line_ratio
            and repeated_line_ratio(text) > p.max_repeated_line_ratio
        ):
            return "repeated_lines"
        return None

    def _drop(self, reason: str, text: str, where: str) -> None:
        """Count a record `_filtered` drops (empty and too_long are bad input: strict mode
        stops on them; counts.drop lets the other reasons through whatever on_error says)."""
        p = self.p
        detail = f"{len(text)} characters > max_chars={p.max_chars}" if reason == "too_long" else ""
        self.counts.drop(reason, where, p.on_error, detail)

    def _keep_chat(self, rec: Record) -> tuple[Record, bool] | None:
        """A chat as its template rendered it: not normalized, since its whitespace and markup
        are the model's format, and the server renders them unchanged. The filters read the
        messages' contents, not the markup around them (a short chat in Llama 3's headers is
        mostly symbols, and repeated role headers are not repeated lines); duplicates are
        equal renderings."""
        p, counts = self.p, self.counts
        content = "\n".join([m["content"] for m in rec.messages or ()])
        if not content.strip():
            counts.drop("empty", rec.where, p.on_error, "every message is empty")
            return None
        if len(rec.text) > p.max_chars:
            detail = f"{len(rec.text)} characters > max_chars={p.max_chars}"
            counts.drop("too_long", rec.where, p.on_error, detail)
            return None
        if len(content) < p.min_chars:
            counts.drop("too_short", rec.where, "skip")
            return None
        if symbol_ratio(content) > p.max_symbol_ratio:
            counts.drop("symbol_ratio", rec.where, "skip")
            return None
        if repeated_line_ratio(content) > p.max_repeated_line_ratio:
            counts.drop("repeated_lines", rec.where, "skip")
            return None
        key = digest(rec.text)
        if not self._unique(key, content, rec.where):
            return None
        return rec, _is_val(key, p.val_fraction)

    def _unique(self, key: bytes, text: str, where: str) -> bool:
        """Kept (and counted) unless `_seen_as` says it is a duplicate (counted dropped)."""
        seen_as = self._seen_as(key, text)
        if seen_as is not None:
            self.counts.drop(seen_as, where, "skip")
            return False
        self.counts.kept += 1
        return True

    def _seen_as(self, key: bytes, text: str) -> str | None:
        """`duplicate` if `key` was seen, `near_duplicate` if `text` is near one seen (with
        near_dedup), else None, and the record is remembered as seen."""
        if key in self.seen:
            return "duplicate"
        self.seen.add(key)
        if self.near is not None and self.near.is_duplicate(text):
            return "near_duplicate"
        return None


_Encoded = tuple[list[bool], list[Any], list[tuple[bool, ...]], list[Any]]
_PAIR = (False, True)  # a prompt, then its completion


def _encode(tokenizer: Any, records: list[Record | str], mask_prompt: bool) -> _Encoded:
    """The tokenizer's calls for `records`: (split, whole, flags, pieces) encodings.

    Records with a prompt are encoded in pieces when the prompt is masked, so each boundary
    is exact (and the prompt's ids are the ones a server encodes it to): prompt/completion
    pairs in two, rendered chats in their segments (`flags`: which piece is trained, per
    record); plain text is one part, all targets. Only the Rust calls (they release the GIL
    and use every core); `_docs` takes the ids out, so a thread running this one is free
    to start the next batch meanwhile.
    """
    backend = tokenizer.backend_tokenizer
    # encode_batch_fast: the same ids as encode_batch, without computing character offsets
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    split = [mask_prompt and not isinstance(r, str) and r.is_pair for r in records]
    if not any(split):
        plain = [r if isinstance(r, str) else r.text for r in records]
        return split, encode(plain, add_special_tokens=False), [], []
    whole = encode(
        [r if isinstance(r, str) else r.text for r, s in zip(records, split, strict=True) if not s],
        add_special_tokens=False,
    )
    texts: list[str] = []
    flags: list[tuple[bool, ...]] = []
    for r, s in zip(records, split, strict=True):
        if not s or isinstance(r, str):
            continue
        if r.segments is None:
            texts += (r.prompt or "", r.completion or "")
            flags.append(_PAIR)
        else:
            texts += [t for t, _ in r.segments]
            flags.append(tuple([trained for _, trained in r.segments]))
    return split, whole, flags, encode(texts, add_special_tokens=False)


def _docs(encoded: _Encoded) -> list[Doc]:
    split, whole, flags, pieces = encoded
    if not flags:
        return [(e.ids, 0) for e in whole]
    out: list[Doc] = []
    it_whole, it_flags, it_pieces = iter(whole), iter(flags), iter(pieces)
    for s in split:
        if not s:
            out.append((next(it_whole).ids, 0))
            continue
        f = next(it_flags)
        if f == _PAIR:
            p, a = next(it_pieces).ids, next(it_pieces).ids
            out.append((p + a, len(p)))
            continue
        ids: list[int] = []
        masks = []
        for trained in f:  # a chat with several trained turns: a mask per token
            piece = next(it_pieces).ids
            ids += piece
            masks.append(np.full(len(piece), trained, dtype=np.int8))
        out.append((ids, np.concatenate(masks) if masks else np.empty(0, np.int8)))
    return out


class _ShardWriter:
    """Rolling Parquet shards of one split, `shard_rows` rows each, with their digests."""

    def __init__(self, out: Path, shard_rows: int, with_mask: bool) -> None:
        self.out = out
        self.shard_rows = shard_rows
        self.with_mask = with_mask
        self.shards: list[dict[str, Any]] = []
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._path: Path | None = None
        self._in_shard = 0
        out.mkdir(parents=True, exist_ok=True)
        fields = [pa.field("input_ids", pa.list_(pa.int32()))]
        if with_mask:
            fields.append(pa.field("loss_mask", pa.list_(pa.int8())))
        self.schema = pa.schema(fields)

    def write(self, rows: Rows) -> None:
        start = 0
        while start < len(rows):
            if self._writer is None:
                self._path = self.out / f"shard-{len(self.shards):05d}.parquet"
                self._writer = pq.ParquetWriter(self._path, self.schema, compression="zstd")
                self._in_shard = 0
            take = min(len(rows) - start, self.shard_rows - self._in_shard)
            self._writer.write_table(self._table(rows, start, start + take))
            self._in_shard += take
            self.rows += take
            start += take
            if self._in_shard == self.shard_rows:
                self._close()

    def _table(self, rows: Rows, a: int, b: int) -> pa.Table:
        seq_len = rows.ids.shape[1]
        n = b - a
        offsets = _arrow(np.arange(0, (n + 1) * seq_len, seq_len, dtype=np.int32))
        cols = [pa.ListArray.from_arrays(offsets, _arrow(rows.ids[a:b].reshape(-1)))]
        if self.with_mask:
            cols.append(pa.ListArray.from_arrays(offsets, _arrow(rows.mask[a:b].reshape(-1))))
        return pa.Table.from_arrays(cols, schema=self.schema)

    def _close(self) -> None:
        if self._writer is None or self._path is None:
            return
        self._writer.close()
        with open(self._path, "rb") as fh:  # streamed: a shard can be hundreds of MB
            sha = hashlib.file_digest(fh, "sha256").hexdigest()
        name = f"{self.out.name}/{self._path.name}"
        self.shards.append({"name": name, "rows": self._in_shard, "sha256": sha})
        self._writer = None

    def close(self) -> list[dict[str, Any]]:
        self._close()
        return self.shards


def _arrow(values: np.ndarray) -> pa.Array:
    """A numpy array as an Arrow array, zero-copy.

    `pa.array` imports pandas on its first call (to check for pandas objects): over a
    second of `kubellm prepare`'s start-up, for a library prepare never uses.
    """
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(
        pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)]
    )


def _arrow_strings(texts: list[str]) -> pa.Array:
    """`pa.array(texts, pa.string())` without pandas (see `_arrow`)."""
    data = [t.encode("utf-8") for t in texts]
    offsets = np.zeros(len(data) + 1, dtype=np.int32)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.string(), len(data), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))]
    )


@dataclass
class _Split:
    packer: ConcatPacker | BestFitPacker
    writer: _ShardWriter
    pending: list[Record | str]  # cleaned, not yet sent to the tokenizer (str: plain text)
    pending_chars: int = 0
    in_group: int = 0  # records since the last group ended
    group_rows: list[Rows] = field(default_factory=list)  # packed (concat), not yet written
    group_docs: list[Doc] = field(default_factory=list)  # tokenized (best_fit), not packed
    tokens: int = 0
    documents: int = 0
    masked: int = 0


def _train_tokenizer(p: PrepareParams) -> Any:
    """A byte-level BPE learned from up to `tokenizer_sample` cleaned training records."""
    sample_counts = Counts()
    cleaner = _Cleaner(p, sample_counts)

    def texts() -> Iterator[str]:
        for rec in read_records(p.source, p.source_options(), sample_counts):
            kept = cleaner.keep(rec)
            if kept is not None and not kept[1]:
                rec = kept[0]
                # a rendered chat's EOS is the special token: nothing for the BPE to learn
                yield rec.text if rec.segments is None else rec.text.replace(EOS, "")

    return train_bpe(islice(texts(), p.tokenizer_sample), p.vocab_size)


def _progress(counts: Counts, tokens: int, t0: float) -> str:
    dt = max(time.monotonic() - t0, 1e-9)
    return (
        f"prepare: records={counts.read} ({counts.read / dt:,.0f}/s) kept={counts.kept} "
        f"tokens={tokens} ({tokens / dt:,.0f}/s)"
    )


def prepare(params: PrepareParams, out_dir: str | Path) -> dict[str, Any]:
    """Build the Dataset artifact in `out_dir`; returns the manifest."""
    with _no_cyclic_gc():
        return _prepare(params, out_dir)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting still frees everything).

    prepare makes millions of short-lived objects (records, id lists) and no reference
    cycles of its own, so a collection finds nothing to free and only rescans the heap the
    imports left (torch, transformers). On the benchmark's 20 MiB corpora one full pass
    landed in every run: 0.11 s, single-threaded, of a 3 s run.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _prepare(params: PrepareParams, out_dir: str | Path) -> dict[str, Any]:
    p = params
    if p.packing not in ("concat", "best_fit"):
        raise DataError(f"packing={p.packing!r}: allowed 'concat', 'best_fit'")
    t0 = time.monotonic()
    check_parts(p.source, p.allow_http)  # before anything is written
    if p.tokenizer and os.path.exists(p.tokenizer):  # a folder, not a hub name
        check_local(p.tokenizer, "tokenizer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if p.tokenizer:
        tokenizer = load_tokenizer(p.tokenizer, trust_remote_code=p.trust_remote_code)
        tok_info = {"kind": "pretrained", "source": p.tokenizer}
    else:
        tokenizer = _train_tokenizer(p)
        tok_info = {"kind": "byte-level-bpe", "source": "trained on this data"}
    chat = None
    if p.template != "none":
        # chats are rendered in the tokenizer's own format; one without a template gets the
        # default, saved with it, so the served model renders prompts as training did
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        chat = ChatFormat.from_tokenizer(tokenizer, p.chat_loss)
        tok_info["chat_template"] = "default" if chat.is_default else "tokenizer's own"
    tokenizer.save_pretrained(out / "tokenizer")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {p.tokenizer!r} has no EOS token to separate documents")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    counts = Counts()
    cleaner = _Cleaner(p, counts)
    with_mask = p.mask_prompt or p.packing == "best_fit"
    splits = {
        name: _Split(
            make_packer(p.packing, p.seq_len, eos, pad),
            _ShardWriter(out / name, p.shard_rows, with_mask),
            [],
        )
        for name in ("train", "val")
    }
    examples: list[dict[str, str]] = []

    eos_tail = (eos,)

    def pack(split: _Split, encoded: Future[_Encoded] | None, end: bool, final: bool) -> None:
        """Take the ids out of one tokenized batch, pack them, and write each finished group.

        Runs in the packing thread, batches in order. A group is `batch_records` records of
        a split (or what is left at the end): rows are written a group at a time and
        best-fit packs a group at a time, so the shards do not depend on how a group was
        cut into tokenizer batches.
        """
        result = encoded.result() if encoded is not None else None
        if isinstance(split.packer, ConcatPacker) and result is not None and not result[2]:
            # plain text, concatenated: the ids go from each encoding straight into one
            # array, no per-document lists kept (the same rows as packer.add of the docs)
            whole = result[1]
            total = sum(map(len, whole)) + len(whole)
            parts = chain.from_iterable(x for e in whole for x in (e.ids, eos_tail))
            ids = np.fromiter(parts, dtype=np.int32, count=total)
            split.documents += len(whole)
            split.tokens += total
            split.group_rows.append(split.packer.add_flat(ids))
            docs: list[Doc] = []
        else:
            docs = _docs(result) if result is not None else []
            split.documents += len(docs)
            split.masked += sum(1 for _, n in docs if is_masked(n))
            split.tokens += sum(len(ids) + 1 for ids, _ in docs)
        if isinstance(split.packer, ConcatPacker):
            if docs:
                split.group_rows.append(split.packer.add(docs))
            if end and split.group_rows:
                rows, split.group_rows = split.group_rows, []
                split.writer.write(rows[0] if len(rows) == 1 else concat_rows(rows))
        else:
            split.group_docs += docs
            if end:
                group, split.group_docs = split.group_docs, []
                if group:
                    split.writer.write(split.packer.add(group))
        if final:
            split.writer.write(split.packer.finish())

    total_tokens = 0
    last_report = time.monotonic()
    # Three threads: this one reads and cleans; "tokenize" only calls the tokenizer (which
    # releases the GIL and runs on every core); "pack" takes the ids out, packs and writes.
    # The tokenizer never waits for Python work to finish, so every core stays busy.
    with (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as tok_pool,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="pack") as pack_pool,
    ):
        inflight: deque[Future[None]] = deque()

        def submit(split: _Split, end: bool, final: bool = False) -> None:
            records, split.pending, split.pending_chars = split.pending, [], 0
            if end:
                split.in_group = 0
            encoded = (
                tok_pool.submit(_encode, tokenizer, records, p.mask_prompt) if records else None
            )
            # one worker each, FIFO: batches are packed and written in order (deterministic)
            inflight.append(pack_pool.submit(pack, split, encoded, end, final))
            while len(inflight) > _MAX_INFLIGHT:  # bounded memory: a few batches at a time
                inflight.popleft().result()

        def add(split: _Split, item: Record | str, chars: int) -> None:
            """A kept record (plain text from a TextBatch: its text) into its split."""
            split.pending.append(item)
            split.pending_chars += chars
            split.in_group += 1
            if split.in_group >= p.batch_records:
                submit(split, end=True)
            elif split.pending_chars >= _BATCH_CHARS:
                submit(split, end=False)

        train, val = splits["train"], splits["val"]
        for item in read_batches(p.source, p.source_options(chat), counts):
            if isinstance(item, TextBatch):
                for text, held_out in zip(*cleaner.keep_batch(item), strict=True):
                    add(val if held_out else train, text, len(text))
            else:
                kept = cleaner.keep(item)
                if kept is None:
                    continue
                rec, held_out = kept
                if held_out and rec.is_pair and len(examples) < MAX_EXAMPLES:
                    if chat is not None and rec.messages is not None:
                        examples.append(chat.example(rec.messages))
                    else:
                        examples.append(
                            {"prompt": rec.prompt or "", "completion": rec.completion or ""}
                        )
                add(val if held_out else train, rec, len(rec.text))
            if p.progress_s and time.monotonic() - last_report > p.progress_s:
                total_tokens = sum(s.tokens for s in splits.values())
                print(_progress(counts, total_tokens, t0), file=sys.stderr, flush=True)
                last_report = time.monotonic()
        for split in splits.values():
            submit(split, end=True, final=True)
        while inflight:
            inflight.popleft().result()

    counts.assert_reconciled()
    files = source_files(p.source, p.allow_http)
    shards: list[dict[str, Any]] = []
    for name, split in splits.items():
        shards += split.writer.close()
        if split.writer.rows == 0:
            if split.documents == 0:
                raise DataError(
                    f"no {'training' if name == 'train' else 'validation'} records left: read "
                    f"{counts.read}, kept {counts.kept}, dropped by reason: {counts.summary()}"
                )
            raise DataError(
                f"{name} split has {split.tokens} tokens, fewer than one row of seq_len={p.seq_len}"
            )

    (out / "eval").mkdir(exist_ok=True)
    columns = {
        "prompt": _arrow_strings([e["prompt"] for e in examples]),
        "completion": _arrow_strings([e["completion"] for e in examples]),
    }
    if any("messages" in e for e in examples):  # chats: the messages before the answer, JSON
        columns["messages"] = pa.array([e.get("messages", "") for e in examples], pa.string())
    pq.write_table(pa.table(columns), out / "eval" / "examples.parquet")
    elapsed = time.monotonic() - t0
    total_tokens = sum(s.tokens for s in splits.values())
    rows_tokens = sum(s.writer.rows for s in splits.values()) * p.seq_len
    stats = [s.packer.stats for s in splits.values()]
    packing = {
        "strategy": p.packing,
        **_combined(stats, rows_tokens),
    }
    manifest: dict[str, Any] = {
        "records": {
            "read": counts.read,
            "kept": counts.kept,
            "dropped": dict(sorted(counts.dropped.items())),
            "train": splits["train"].documents,
            "val": splits["val"].documents,
            "eval_examples": len(examples),
        },
        "tokens": {
            "train": splits["train"].tokens,
            "val": splits["val"].tokens,
            "cropped": {k: s.packer.stats.cropped for k, s in splits.items()},
        },
        "seq_len": p.seq_len,
        "rows": {k: s.writer.rows for k, s in splits.items()},
        "packing": packing,
        "loss_masked_documents": sum(s.masked for s in splits.values()),
        "shards": shards,
        "tokenizer": {**tok_info, "vocab_size": len(tokenizer), "eos_id": eos, "pad_id": pad},
        "params": asdict(p),
        "source_fingerprint": cleaner.fingerprint.hexdigest(),
        "source_files": {"count": len(files), "names": files[:MAX_LISTED_FILES]},
        "seconds": round(elapsed, 3),
    }
    manifest["data_fingerprint"] = data_fingerprint(
        manifest["params"], manifest["source_fingerprint"], out
    )
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    print(
        f"prepare: read={counts.read} kept={counts.kept} "
        f"train={splits['train'].documents} val={splits['val'].documents} "
        f"dropped: {counts.summary()}",
        flush=True,
    )
    print(
        f"prepare: tokens={total_tokens} rows={rows_tokens // p.seq_len} "
        f"tokens_per_sec={total_tokens / max(elapsed, 1e-9):.0f} "
        f"padding_pct={packing['padding_pct']} cropped_pct={packing['cropped_pct']} "
        f"fingerprint={manifest['source_fingerprint'][:12]}",
        file=sys.stderr,
        flush=True,
    )
    return manifest


def _combined(stats: list[PackStats], rows_tokens: int) -> dict[str, float]:
    total = PackStats()
    for s in stats:
        total.tokens += s.tokens
        total.padding += s.padding
        total.cropped += s.cropped
    return dict(total.percentages(rows_tokens))
