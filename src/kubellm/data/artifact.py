"""The Dataset artifact, read side: the one place train, evaluate and tools open it.

prepare_data writes the layout below (see kubellm.data.prepare); everything that reads it
goes through these functions, so the contract has one home:

    manifest.json               counts, tokens, seq_len, shard digests, source and data
                                fingerprints
    train/*.parquet, val/*.parquet   packed rows: input_ids, loss_mask
    eval/examples.parquet       prompt, completion (held-out records that have them)
    tokenizer/                  Hugging Face tokenizer files
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq

if TYPE_CHECKING:
    import torch

from kubellm.data.records import DataError

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
EVAL_EXAMPLES = Path("eval") / "examples.parquet"
# Labels of positions that carry no loss (prompt tokens, padding): PyTorch's ignore_index.
IGNORE_INDEX = -100


def load_manifest(dataset_dir: str | Path) -> dict[str, Any]:
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{dataset_dir} is not a kubellm dataset: {MANIFEST} is missing")
    return dict(json.loads(path.read_text()))


def tokenizer_dir(dataset_dir: str | Path) -> Path:
    return Path(dataset_dir) / TOKENIZER_DIR


# Preparation parameters that change how a run goes, not what it makes.
_NOT_DATA = ("progress_s", "batch_records")


def data_fingerprint(
    params: dict[str, Any], source_fingerprint: str, dataset_dir: str | Path
) -> str:
    """What a dataset is made of: the source records (their fingerprint), the preparation
    parameters and the tokenizer's files. Equal fingerprints, equal datasets; recurring
    runs compare it with the champion's to skip retraining on data they already saw."""
    h = hashlib.sha256()
    h.update(source_fingerprint.encode())
    settings = {k: v for k, v in params.items() if k not in _NOT_DATA}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    tok = tokenizer_dir(dataset_dir)
    for f in sorted(p for p in tok.rglob("*") if p.is_file()):
        h.update(f.relative_to(tok).as_posix().encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def load_eval_examples(dataset_dir: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Held-out prompt/completion records (empty when the data has none, e.g. plain text)."""
    path = Path(dataset_dir) / EVAL_EXAMPLES
    if not path.is_file():
        return []
    rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    return rows[:limit] if limit is not None else rows


def load_split(dataset_dir: str | Path, split: str) -> torch.Tensor:
    """Rows of a split as int32, shape (2, N, seq_len): input ids and labels (-100 masked)."""
    import torch  # here, not at import: prepare_data reads this module and needs no torch

    files = sorted((Path(dataset_dir) / split).glob("*.parquet"))
    if not files:
        raise DataError(f"{dataset_dir}/{split} has no Parquet shards")
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    seq_len = 0
    for f in files:
        table = pq.read_table(f)
        col = table.column("input_ids").combine_chunks()
        if len(col) == 0:
            continue
        flat = np.asarray(col.flatten(), dtype=np.int32)
        seq_len = seq_len or len(flat) // len(col)
        if len(flat) != seq_len * len(col):
            raise DataError(f"{f}: rows are not all {seq_len} tokens long (not a packed shard)")
        ids_parts.append(flat.reshape(len(col), seq_len))
        if "loss_mask" in table.column_names:
            m = np.asarray(table.column("loss_mask").combine_chunks().flatten(), dtype=np.bool_)
            mask_parts.append(m.reshape(len(col), seq_len))
        else:
            mask_parts.append(np.ones((len(col), seq_len), dtype=np.bool_))
    if not ids_parts:
        raise DataError(f"{dataset_dir}/{split} has no rows")
    ids = torch.from_numpy(np.concatenate(ids_parts))
    keep = torch.from_numpy(np.concatenate(mask_parts))
    return torch.stack([ids, ids.masked_fill(~keep, IGNORE_INDEX)])
