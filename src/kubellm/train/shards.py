"""The trainer's view of a split: verified Parquet shards, cached as memory-mapped arrays.

Each rank used to read a whole split into memory, so host memory per rank grew with the
corpus. Here every shard listed in manifest.json is converted once per node into a
node-local, content-addressed cache:

    <cache_dir>/<sha256>.ids.npy    int32, (rows, seq_len)
    <cache_dir>/<sha256>.mask.npy   bool, (rows, seq_len); only for shards with a loss_mask
    <cache_dir>/<sha256>.lock       the flock the node's ranks take to convert it once

before a shard is converted its bytes are checked against the manifest's digest, its rows
against the manifest's count and seq_len, so a truncated or modified shard is one line that
names it (DataError), raised before torch.distributed starts (`verify`). A cached file is
named by the digest of what it was converted from and is written (temp name, os.replace)
only after that check, so it is trusted as it is. Ranks then memory-map the arrays: the page
cache holds what is read, shared by the node's ranks, and a rank copies only the rows of
its batch (`ShardRows.rows`).

cache_dir: the argument, else $KUBELLM_SHARD_CACHE, else <tmp>/kubellm-shards. It needs
about 5 bytes per token of room (4 for ids, 1 for the mask) and should be node-local.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kubellm.data.artifact import IGNORE_INDEX, MANIFEST, load_manifest
from kubellm.data.records import DataError

CACHE_ENV = "KUBELLM_SHARD_CACHE"
# Tokens per record batch while converting: bounds the conversion's memory (about 5 bytes
# each, plus Parquet's decoded row group), whatever the shard's size.
_BATCH_TOKENS = 1 << 22


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path(tempfile.gettempdir()) / "kubellm-shards"


@dataclass(frozen=True)
class _Shard:
    name: str  # "train/shard-00000.parquet", relative to the dataset
    rows: int
    sha256: str


class ShardRows:
    """A split's rows over memory-mapped shards; `rows` copies only the rows asked for."""

    def __init__(self, parts: Sequence[tuple[np.ndarray, np.ndarray | None]], seq_len: int) -> None:
        self._ids = [ids for ids, _ in parts]
        self._masks = [mask for _, mask in parts]
        self._seq_len = seq_len
        counts = np.array([len(ids) for ids in self._ids], dtype=np.int64)
        # Global row r is in shard searchsorted(ends, r, "right"), at local row r - starts[s].
        self._ends = np.cumsum(counts)
        self._starts = self._ends - counts

    @property
    def num_sequences(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def __len__(self) -> int:
        return self.num_sequences

    def rows(
        self, indices: torch.Tensor | np.ndarray | Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int32 (2, k, seq_len): [input ids, labels] of the rows `indices`, in that order.

        Labels are the ids where the loss mask is set, IGNORE_INDEX elsewhere. `out` (an int32
        CPU tensor of that shape, e.g. pinned) receives them instead of a new tensor.
        """
        if isinstance(indices, torch.Tensor):
            indices = indices.cpu().numpy()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self.num_sequences
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"row index out of range for a split of {n} sequences")
        shape = (2, len(idx), self._seq_len)
        if out is None:
            out = torch.empty(shape, dtype=torch.int32)
        elif out.dtype != torch.int32 or tuple(out.shape) != shape:
            raise ValueError(f"out must be int32 of shape {shape}, not {out.dtype} {out.shape}")
        dst = out.numpy()
        shard_of = np.searchsorted(self._ends, idx, side="right")
        for s in np.unique(shard_of):
            at = np.flatnonzero(shard_of == s)
            local = idx[at] - self._starts[s]
            ids = self._ids[s][local]  # fancy indexing a memmap: reads these rows only
            dst[0, at] = ids
            mask = self._masks[s]
            dst[1, at] = ids if mask is None else np.where(mask[local], ids, IGNORE_INDEX)
        return out


def open_split(
    dataset_dir: str | Path, split: str, cache_dir: str | Path | None = None
) -> ShardRows:
    """The split's rows, memory-mapped from the node's cache (filled and verified if needed).

    Raises DataError, one line naming the shard, when a shard is missing, unlisted, does not
    match the manifest's digest or row count, or is not a packed Parquet shard.
    """
    manifest = load_manifest(dataset_dir)
    seq_len = int(manifest["seq_len"])
    shards = _listed(Path(dataset_dir), split, manifest)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"cannot create the shard cache {cache}: {err.strerror} (set {CACHE_ENV} to a "
            "writable node-local directory)"
        ) from None
    parts: list[tuple[np.ndarray, np.ndarray | None]] = []
    for shard in shards:
        if shard.rows == 0:
            continue  # prepare_data writes none; nothing to read either way
        cached = _load_cached(cache, shard, seq_len)
        if cached is None:
            with _locked(cache, shard):
                cached = _load_cached(cache, shard, seq_len)  # another rank may have done it
                if cached is None:
                    _convert(Path(dataset_dir), cache, shard, seq_len)
                    cached = _load_cached(cache, shard, seq_len)
            if cached is None:  # written just now, unreadable: the cache's disk is at fault
                raise DataError(f"{shard.name}: its cache in {cache} cannot be read back")
        parts.append(cached)
    if not parts:
        raise DataError(f"{dataset_dir}/{split} has no rows")
    return ShardRows(parts, seq_len)


def verify(
    dataset_dir: str | Path,
    splits: Sequence[str] = ("train", "val"),
    cache_dir: str | Path | None = None,
) -> dict[str, int]:
    """Open the splits (filling the node's cache): the trainer's check before the process
    group, so a bad shard is one DataError, not a traceback from every rank. Returns the
    number of sequences of each split."""
    return {split: open_split(dataset_dir, split, cache_dir).num_sequences for split in splits}


def _listed(dataset_dir: Path, split: str, manifest: dict[str, Any]) -> list[_Shard]:
    """The split's shards as the manifest lists them; files it does not list are errors."""
    try:
        shards = [
            _Shard(str(s["name"]), int(s["rows"]), str(s["sha256"]))
            for s in manifest.get("shards", [])
            if str(s["name"]).startswith(f"{split}/")
        ]
    except (KeyError, TypeError, ValueError):
        raise DataError(
            f"{MANIFEST}: its shard list has no name, rows and sha256 for every shard "
            "(written by an older kubellm? run prepare_data again)"
        ) from None
    if not shards:
        raise DataError(f"{MANIFEST} lists no {split} shards")
    listed = {s.name for s in shards}
    for f in sorted((dataset_dir / split).glob("*.parquet")):
        name = f"{split}/{f.name}"
        if name not in listed:
            raise DataError(
                f"{name}: not listed in {MANIFEST} (added after prepare_data? remove it or "
                "prepare the data again)"
            )
    for s in shards:
        if not (dataset_dir / s.name).is_file():
            raise DataError(f"{s.name}: listed in {MANIFEST} but missing")
    return shards


def _paths(cache: Path, shard: _Shard) -> tuple[Path, Path]:
    return cache / f"{shard.sha256}.ids.npy", cache / f"{shard.sha256}.mask.npy"


def _load_cached(
    cache: Path, shard: _Shard, seq_len: int
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The memory-mapped arrays, or None when not (fully, sanely) cached yet.

    The ids file is written last, so its presence means the conversion finished; a mask
    file then exists exactly when the shard has a loss_mask.
    """
    ids_path, mask_path = _paths(cache, shard)
    try:
        ids = np.load(ids_path, mmap_mode="r")
        mask = np.load(mask_path, mmap_mode="r") if mask_path.exists() else None
    except (OSError, ValueError):
        return None
    want = (shard.rows, seq_len)
    if ids.dtype != np.int32 or ids.shape != want:
        return None
    if mask is not None and (mask.dtype != np.bool_ or mask.shape != want):
        return None
    return ids, mask


@contextmanager
def _locked(cache: Path, shard: _Shard) -> Iterator[None]:
    """An exclusive flock per shard: a node's ranks start together, one converts."""
    fd = os.open(cache / f"{shard.sha256}.lock", os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:  # streamed: a shard can be hundreds of MB
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _convert(dataset_dir: Path, cache: Path, shard: _Shard, seq_len: int) -> None:
    """Verify the shard against the manifest, then write its cache files (mask, then ids)."""
    path = dataset_dir / shard.name
    try:
        digest = _sha256(path)
    except OSError as err:
        raise DataError(f"{shard.name}: cannot be read: {err.strerror}") from None
    if digest != shard.sha256:
        raise DataError(
            f"{shard.name}: sha256 {digest[:12]}… does not match the manifest's "
            f"{shard.sha256[:12]}… (truncated or modified after prepare_data)"
        )
    try:
        pf = pq.ParquetFile(path)
        columns = pf.schema_arrow.names
        if "input_ids" not in columns:
            raise DataError(f"{shard.name}: has no input_ids column (not a packed shard)")
        if pf.metadata.num_rows != shard.rows:
            raise DataError(
                f"{shard.name}: has {pf.metadata.num_rows} rows, the manifest says {shard.rows}"
            )
        with_mask = "loss_mask" in columns
        ids_path, mask_path = _paths(cache, shard)
        tmp: list[Path] = []
        try:
            ids_tmp = _temp(cache, shard, tmp)
            mask_tmp = _temp(cache, shard, tmp) if with_mask else None
            _fill(pf, shard, seq_len, ids_tmp, mask_tmp)
            if mask_tmp is not None:
                os.replace(mask_tmp, mask_path)
            else:
                with suppress(FileNotFoundError):
                    mask_path.unlink()  # a stale one would be read as this shard's mask
            os.replace(ids_tmp, ids_path)  # last: its presence means the shard is cached
        finally:
            for t in tmp:
                with suppress(FileNotFoundError):
                    t.unlink()
    except DataError:
        raise
    except (pa.ArrowException, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{shard.name}: unreadable Parquet ({first})") from None
    except OSError as err:
        raise DataError(
            f"{shard.name}: cannot be cached in {cache}: {err.strerror or err} (set {CACHE_ENV} "
            "to a node-local directory with about 5 bytes of room per token)"
        ) from None


def _temp(cache: Path, shard: _Shard, made: list[Path]) -> Path:
    fd, name = tempfile.mkstemp(dir=cache, prefix=f".{shard.sha256[:16]}.", suffix=".tmp")
    os.close(fd)
    made.append(Path(name))
    return Path(name)


def _fill(
    pf: pq.ParquetFile, shard: _Shard, seq_len: int, ids_tmp: Path, mask_tmp: Path | None
) -> None:
    """Stream the shard's record batches into the cache's .npy files (through the page
    cache: one batch in memory at a time)."""
    shape = (shard.rows, seq_len)
    ids_out = np.lib.format.open_memmap(ids_tmp, mode="w+", dtype=np.int32, shape=shape)
    mask_out = (
        np.lib.format.open_memmap(mask_tmp, mode="w+", dtype=np.bool_, shape=shape)
        if mask_tmp is not None
        else None
    )
    columns = ["input_ids"] + (["loss_mask"] if mask_out is not None else [])
    row = 0
    for batch in pf.iter_batches(batch_size=max(1, _BATCH_TOKENS // seq_len), columns=columns):
        n = batch.num_rows
        if row + n > shard.rows:
            raise DataError(f"{shard.name}: has more rows than the manifest's {shard.rows}")
        ids_out[row : row + n] = _packed(batch.column(0), shard, seq_len, np.int32)
        if mask_out is not None:
            mask_out[row : row + n] = _packed(batch.column(1), shard, seq_len, np.int8) != 0
        row += n
    if row != shard.rows:
        raise DataError(f"{shard.name}: has {row} rows, the manifest says {shard.rows}")
    ids_out.flush()
    if mask_out is not None:
        mask_out.flush()
    del ids_out, mask_out  # unmapped before the files are renamed


def _packed(col: Any, shard: _Shard, seq_len: int, dtype: type[np.generic]) -> np.ndarray:
    """A list column of one batch as (rows, seq_len); every row exactly seq_len long."""
    if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
        raise DataError(f"{shard.name}: column of {col.type}, not token lists (not a packed shard)")
    offsets = np.asarray(col.offsets)
    values = col.flatten()
    if (
        col.null_count
        or values.null_count
        or (len(offsets) > 1 and not (np.diff(offsets) == seq_len).all())
    ):
        raise DataError(
            f"{shard.name}: rows are not all {seq_len} tokens long (not a packed shard)"
        )
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=dtype).reshape(-1, seq_len)
