"""prepare_data: read, clean, dedup, split, tokenize, pack and shard text to Parquet.

The Dataset artifact it writes is the contract with every later stage:

    train/shard-00000.parquet   input_ids: list<int32>, one packed sequence a row
    val/shard-00000.parquet     the same for held-out records
    eval/examples.parquet       prompt, completion (held-out records that have them)
    tokenizer/                  Hugging Face tokenizer files
    manifest.json               counts (read = kept + dropped), tokens, shard digests, fingerprint

Nothing is dropped silently: each dropped record is counted under its reason.
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
import sys
import time
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kubellm.data.records import Counts, DataError
from kubellm.data.synthetic import arithmetic_records
from kubellm.data.tokenizer import train_bpe

MANIFEST = "manifest.json"
_WS = re.compile(r"[ \t\r\f\v]+")


@dataclass
class PrepareParams:
    source: str = "synthetic"
    text_field: str = "text"
    num_records: int = 20000  # synthetic only
    seed: int = 0
    val_fraction: float = 0.1
    vocab_size: int = 512
    seq_len: int = 32
    min_chars: int = 1
    max_chars: int = 100_000
    shard_rows: int = 65_536
    on_error: str = "skip"  # or "fail"
    mask_prompt: bool = True  # records with prompt/completion: loss on the completion only


def _read_source(p: PrepareParams, counts: Counts) -> Iterator[dict[str, Any]]:
    """Records from the source; malformed ones are counted (or fail, with file and line)."""
    if p.source == "synthetic":
        yield from arithmetic_records(p.num_records, seed=p.seed)
        return
    paths = sorted(glob.glob(p.source)) or ([p.source] if Path(p.source).is_file() else [])
    if not paths:
        raise DataError(f"data_source {p.source!r} matches no file")
    for path in paths:
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    counts.read += 1
                    counts.drop("invalid_utf8", where, p.on_error)  # type: ignore[arg-type]
                    continue
                except json.JSONDecodeError as err:
                    counts.read += 1
                    counts.drop("malformed_json", where, p.on_error, str(err))  # type: ignore[arg-type]
                    continue
                if not isinstance(rec, dict) or not isinstance(rec.get(p.text_field), str):
                    counts.read += 1
                    detail = f"no string field {p.text_field!r}"
                    counts.drop("missing_text", where, p.on_error, detail)  # type: ignore[arg-type]
                    continue
                yield {**rec, "text": rec[p.text_field]}


def normalize(text: str) -> str:
    """Unicode NFC, runs of horizontal whitespace folded, lines stripped."""
    text = unicodedata.normalize("NFC", text)
    return "\n".join(_WS.sub(" ", line).strip() for line in text.splitlines()).strip()


def is_validation(text: str, val_fraction: float) -> bool:
    """Split by content hash: a record's side never changes when data is appended."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return (h % 1_000_000) < val_fraction * 1_000_000


@dataclass
class Packed:
    rows: list[list[int]]
    masks: list[list[int]] | None
    cropped: int


def _pack(docs: Iterable[tuple[list[int], list[int]]], eos: int, seq_len: int) -> Packed:
    """Concatenate (ids, loss mask) documents with EOS separators and chunk to seq_len.

    The mask is 1 where the token is a training target (the EOS that ends a document is
    one: the model must learn to stop). All ones means no mask column is written.
    """
    flat: list[int] = []
    mask: list[int] = []
    for ids, m in docs:
        flat.extend(ids)
        flat.append(eos)
        mask.extend(m)
        mask.append(1)
    n = len(flat) // seq_len
    rows = [flat[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    masks = None if all(mask) else [mask[i * seq_len : (i + 1) * seq_len] for i in range(n)]
    return Packed(rows, masks, len(flat) - n * seq_len)


def _write_shards(out: Path, packed: Packed, shard_rows: int) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    rows = packed.rows
    for i in range(0, max(len(rows), 1), shard_rows):
        chunk = rows[i : i + shard_rows]
        columns = {"input_ids": pa.array(chunk, type=pa.list_(pa.int32()))}
        if packed.masks is not None:
            columns["loss_mask"] = pa.array(packed.masks[i : i + shard_rows], pa.list_(pa.int8()))
        table = pa.table(columns)
        path = out / f"shard-{i // shard_rows:05d}.parquet"
        pq.write_table(table, path, compression="zstd")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shards.append({"name": f"{out.name}/{path.name}", "rows": len(chunk), "sha256": digest})
    return shards


def _tokenize(
    tokenizer: Any, records: list[dict[str, str]], mask_prompt: bool
) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per record, batched through the fast tokenizer.

    Prompt/completion records are encoded in two parts when the prompt is masked, so the
    boundary is exact; plain text is one part, all targets.
    """
    backend = tokenizer.backend_tokenizer
    split = [mask_prompt and "prompt" in r and "completion" in r for r in records]
    whole = backend.encode_batch([r["text"] for r, s in zip(records, split, strict=True) if not s])
    parts = [r for r, s in zip(records, split, strict=True) if s]
    prompts = backend.encode_batch([r["prompt"] for r in parts])
    answers = backend.encode_batch([r["completion"] for r in parts])
    out: list[tuple[list[int], list[int]]] = []
    it_whole, it_p, it_a = iter(whole), iter(prompts), iter(answers)
    for s in split:
        if s:
            p, a = next(it_p).ids, next(it_a).ids
            out.append((p + a, [0] * len(p) + [1] * len(a)))
        else:
            ids = next(it_whole).ids
            out.append((ids, [1] * len(ids)))
    return out


def prepare(params: PrepareParams, out_dir: str | Path) -> dict[str, Any]:
    """Build the Dataset artifact in `out_dir`; returns the manifest."""
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = Counts()
    seen: set[bytes] = set()
    source_hash = hashlib.sha256()
    train: list[dict[str, str]] = []
    val: list[dict[str, str]] = []
    for rec in _read_source(params, counts):
        counts.read += 1
        raw = rec["text"]
        source_hash.update(raw.encode("utf-8", "surrogatepass") + b"\0")
        text = normalize(raw)
        if not text:
            counts.drop("empty", "", "skip")
            continue
        if len(text) < params.min_chars:
            counts.drop("too_short", "", "skip")
            continue
        if len(text) > params.max_chars:
            counts.drop("too_long", "", "skip")
            continue
        key = hashlib.blake2b(text.encode(), digest_size=16).digest()
        if key in seen:
            counts.drop("duplicate", "", "skip")
            continue
        seen.add(key)
        counts.kept += 1
        if is_validation(text, params.val_fraction):
            val.append({"text": text, **{k: rec[k] for k in ("prompt", "completion") if k in rec}})
        else:
            train.append(
                {"text": text, **{k: rec[k] for k in ("prompt", "completion") if k in rec}}
            )
    if not train or not val:
        reasons = ", ".join(f"{k}={v}" for k, v in counts.dropped.most_common()) or "none"
        raise DataError(
            f"no {'training' if not train else 'validation'} records left: read {counts.read}, "
            f"kept {counts.kept}, dropped by reason: {reasons}"
        )
    print(f"prepare: read={counts.read} kept={counts.kept} train={len(train)} val={len(val)}")

    tokenizer = train_bpe((r["text"] for r in train), params.vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    eos = tokenizer.eos_token_id
    assert eos is not None

    token_counts: dict[str, int] = {}
    cropped: dict[str, int] = {}
    shards: list[dict[str, Any]] = []
    masked_docs = 0
    for split, records in (("train", train), ("val", val)):
        docs = _tokenize(tokenizer, records, params.mask_prompt)
        masked_docs += sum(not all(m) for _, m in docs)
        token_counts[split] = sum(len(ids) + 1 for ids, _ in docs)
        packed = _pack(docs, eos, params.seq_len)
        cropped[split] = packed.cropped
        if not packed.rows:
            raise DataError(
                f"{split} split has {token_counts[split]} tokens, fewer than one sequence "
                f"of seq_len={params.seq_len}"
            )
        shards += _write_shards(out / split, packed, params.shard_rows)

    examples = [v for v in val if "prompt" in v and "completion" in v]
    (out / "eval").mkdir(exist_ok=True)
    pq.write_table(
        pa.table(
            {
                "prompt": [e["prompt"] for e in examples],
                "completion": [e["completion"] for e in examples],
            }
        ),
        out / "eval" / "examples.parquet",
    )
    elapsed = time.monotonic() - t0
    total_tokens = sum(token_counts.values())
    manifest: dict[str, Any] = {
        "records": {
            "read": counts.read,
            "kept": counts.kept,
            "dropped": dict(sorted(counts.dropped.items())),
            "train": len(train),
            "val": len(val),
            "eval_examples": len(examples),
        },
        "tokens": {**token_counts, "cropped": cropped},
        "seq_len": params.seq_len,
        "loss_masked_documents": masked_docs,
        "shards": shards,
        "tokenizer": {"kind": "byte-level-bpe", "vocab_size": len(tokenizer), "eos_id": eos},
        "params": vars(params),
        "source_fingerprint": source_hash.hexdigest(),
        "seconds": round(elapsed, 3),
    }
    assert counts.read == counts.kept + sum(counts.dropped.values())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    print(
        f"prepare: tokens={total_tokens} sequences={sum(s['rows'] for s in shards)} "
        f"tokens_per_sec={total_tokens / max(elapsed, 1e-9):.0f} "
        f"fingerprint={manifest['source_fingerprint'][:12]}",
        file=sys.stderr,
    )
    return manifest


def load_manifest(dataset_dir: str | Path) -> dict[str, Any]:
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{dataset_dir} is not a kubellm dataset: {MANIFEST} is missing")
    return dict(json.loads(path.read_text()))
