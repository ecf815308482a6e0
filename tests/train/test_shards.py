"""The trainer's shard cache: verified once per node, memory-mapped, one-line errors."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from kubellm.data.artifact import load_split
from kubellm.data.records import DataError
from kubellm.train import shards
from kubellm.train.loader import DistributedLoader
from kubellm.train.shards import ShardRows, open_split, verify

SEQ = 8


def write_artifact(
    out: Path, splits: dict[str, list[tuple[np.ndarray, np.ndarray | None]]], seq_len: int
) -> None:
    """A dataset artifact as prepare_data lays it out (manifest + packed Parquet shards)."""
    listed = []
    for split, parts in splits.items():
        (out / split).mkdir(parents=True)
        for i, (ids, mask) in enumerate(parts):
            path = out / split / f"shard-{i:05d}.parquet"
            offsets = pa.array(np.arange(len(ids) + 1, dtype=np.int32) * seq_len)
            cols = {"input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.reshape(-1)))}
            if mask is not None:
                flat = pa.array(mask.reshape(-1).astype(np.int8))
                cols["loss_mask"] = pa.ListArray.from_arrays(offsets, flat)
            pq.write_table(pa.table(cols), path, compression="none", use_dictionary=False)
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            listed.append({"name": f"{split}/{path.name}", "rows": len(ids), "sha256": sha})
    manifest = {
        "seq_len": seq_len,
        "rows": {s: sum(len(ids) for ids, _ in parts) for s, parts in splits.items()},
        "shards": listed,
    }
    (out / "manifest.json").write_text(json.dumps(manifest))


def _part(first: int, n: int, masked: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """n rows; row r's ids are (first + r) * 100 + position; odd positions masked."""
    ids = (np.arange(first, first + n)[:, None] * 100 + np.arange(SEQ)).astype(np.int32)
    return ids, (np.arange(SEQ) % 2 == 0).repeat(n).reshape(SEQ, n).T.copy() if masked else None


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    """train: shards of 5 (masked), 1 (no mask) and 7 (masked) rows; val: one of 4."""
    out = tmp_path / "ds"
    write_artifact(
        out,
        {
            "train": [_part(0, 5, True), _part(5, 1, False), _part(6, 7, True)],
            "val": [_part(100, 4, False)],
        },
        SEQ,
    )
    return out


def _one_line_error(dataset: Path, cache: Path, split: str = "train") -> str:
    with pytest.raises(DataError) as info:
        open_split(dataset, split, cache)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_rows_equal_load_split_on_the_prepared_dataset(tiny_dataset: Path, tmp_path: Path) -> None:
    for split in ("train", "val"):
        ref = load_split(tiny_dataset, split)
        rows = open_split(tiny_dataset, split, tmp_path)
        assert (rows.num_sequences, rows.seq_len) == (ref.shape[1], ref.shape[2])
        every = rows.rows(torch.arange(rows.num_sequences))
        assert every.dtype == torch.int32 and torch.equal(every, ref)
        some = torch.randperm(rows.num_sequences, generator=torch.Generator().manual_seed(1))
        assert torch.equal(rows.rows(some[:50]), ref[:, some[:50]])  # the order asked for
    assert (ref[1] == -100).any()  # prompt tokens are masked
    digest = json.loads((tiny_dataset / "manifest.json").read_text())["shards"][0]["sha256"]
    assert (tmp_path / f"{digest}.ids.npy").is_file()
    assert (tmp_path / f"{digest}.mask.npy").is_file()


def test_global_rows_map_across_shards_with_and_without_masks(artifact: Path, tmp_path) -> None:
    rows = open_split(artifact, "train", tmp_path)
    ref = load_split(artifact, "train")
    assert rows.num_sequences == len(rows) == 13 and rows.seq_len == SEQ
    idx = np.array([12, 0, 5, 4, 5, 6, 11, 1])  # across shard boundaries, repeated, unsorted
    got = rows.rows(idx)
    assert torch.equal(got, ref[:, torch.from_numpy(idx)])
    assert got[0, :, 0].tolist() == (idx * 100).tolist()
    assert (got[1, 2] == got[0, 2]).all()  # row 5: the shard without a mask counts all
    assert (got[1, 0, 1::2] == -100).all() and (got[1, 0, ::2] == got[0, 0, ::2]).all()
    out = torch.full((2, 3, SEQ), 7, dtype=torch.int32)
    assert rows.rows([6, 5, 4], out=out) is out and torch.equal(out, ref[:, [6, 5, 4]])
    assert rows.rows(np.array([], dtype=np.int64)).shape == (2, 0, SEQ)
    with pytest.raises(IndexError):
        rows.rows([13])
    assert len(list(tmp_path.glob("*.mask.npy"))) == 2  # the unmasked shard has none


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("truncate", r"sha256 \w+… does not match the manifest's \w+… \(truncated or modified"),
        ("flip", r"sha256 \w+… does not match the manifest's \w+… \(truncated or modified"),
        ("missing", "listed in manifest.json but missing"),
        ("unlisted", "not listed in manifest.json"),
        ("rows", "has 1 rows, the manifest says 2"),
        ("garbage", r"unreadable Parquet \("),
        ("seq_len", "rows are not all 4 tokens long"),
    ],
)
def test_a_bad_shard_is_one_line_naming_it(
    artifact: Path, tmp_path: Path, damage: str, expected: str
) -> None:
    shard = artifact / "train" / "shard-00001.parquet"
    name = "train/shard-00001.parquet"
    manifest = json.loads((artifact / "manifest.json").read_text())
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
    elif damage == "missing":
        shard.unlink()
    elif damage == "unlisted":
        shutil.copy(shard, artifact / "train" / "shard-00009.parquet")
        name = "train/shard-00009.parquet"
    elif damage in ("rows", "garbage"):  # a manifest that agrees on the digest but not else
        if damage == "garbage":
            shard.write_bytes(b"PAR1 this is not a Parquet file PAR1")
        manifest["shards"][1]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
        manifest["shards"][1]["rows"] = 2 if damage == "rows" else 1
    elif damage == "seq_len":
        manifest["seq_len"] = 4
        name = "train/shard-00000.parquet"
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    msg = _one_line_error(artifact, tmp_path / "cache")
    assert msg.startswith(f"{name}: ")
    assert re.search(expected, msg), msg
    assert not list((tmp_path / "cache").glob("*.tmp"))  # nothing half-written is left


def test_verify_checks_every_split_before_training(artifact: Path, tmp_path: Path) -> None:
    assert verify(artifact, cache_dir=tmp_path / "c1") == {"train": 13, "val": 4}
    (artifact / "val" / "shard-00000.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"^val/shard-00000\.parquet: sha256"):
        verify(artifact, cache_dir=tmp_path / "c2")


def test_the_cache_is_content_addressed_and_read_without_the_parquet(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBELLM_SHARD_CACHE", str(tmp_path / "node"))
    first = open_split(artifact, "train").rows(range(13))
    assert len(list((tmp_path / "node").glob("*.ids.npy"))) == 3
    for f in (artifact / "train").glob("*.parquet"):
        f.write_bytes(b"poisoned after the first open")

    def no_conversion(*_: object) -> None:
        raise AssertionError("read the Parquet again")

    with monkeypatch.context() as m:
        m.setattr(shards, "_convert", no_conversion)
        assert torch.equal(open_split(artifact, "train").rows(range(13)), first)
    # another node (cache) verifies the shards itself, and finds them poisoned
    assert "does not match" in _one_line_error(artifact, tmp_path / "other-node")


def test_a_damaged_cache_file_is_rebuilt(artifact: Path, tmp_path: Path) -> None:
    first = open_split(artifact, "train", tmp_path).rows(range(13))
    for f in tmp_path.glob("*.ids.npy"):
        f.write_bytes(f.read_bytes()[:50])
    assert torch.equal(open_split(artifact, "train", tmp_path).rows(range(13)), first)


def test_ranks_starting_together_convert_each_shard_once(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    convert = shards._convert

    def counted(dataset_dir: Path, cache: Path, shard: shards._Shard, seq_len: int) -> None:
        calls.append(shard.name)
        convert(dataset_dir, cache, shard, seq_len)

    monkeypatch.setattr(shards, "_convert", counted)
    start = threading.Barrier(4)
    got: list[ShardRows] = []

    def rank() -> None:
        start.wait()
        got.append(open_split(artifact, "train", tmp_path))  # flock: one descriptor each

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == [f"train/shard-0000{i}.parquet" for i in range(3)]
    assert len(got) == 4 and all(
        torch.equal(g.rows(range(13)), got[0].rows(range(13))) for g in got
    )


def _rss_anon() -> int:
    """Bytes of this process's private anonymous memory (not the page cache an mmap maps)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_host_memory_per_rank_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    seq, per_shard, n_shards = 512, 16_384, 4
    corpus = seq * per_shard * n_shards * 4  # 128 MiB of int32 ids
    parts = []
    for s in range(n_shards):
        first = s * per_shard * seq
        ids = np.arange(first, first + per_shard * seq, dtype=np.int32).reshape(per_shard, seq)
        parts.append((ids, None))
    write_artifact(tmp_path / "ds", {"train": parts}, seq)
    del parts, ids

    tracemalloc.start()
    try:
        verify(tmp_path / "ds", ("train",), tmp_path / "cache")  # converts: bounded too
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < corpus / 8, f"converting held {peak} bytes of arrays for a {corpus}-byte split"

    warm = DistributedLoader(
        torch.zeros(2, 64, seq, dtype=torch.int32),
        global_batch=64,
        micro_batch=16,
        rank=0,
        world_size=2,
        seed=0,
    )
    warm.next_batch()  # torch's and the thread pool's one-off allocations
    warm.close()
    before = _rss_anon()
    rows = open_split(tmp_path / "ds", "train", tmp_path / "cache")
    loader = DistributedLoader(rows, global_batch=64, micro_batch=16, rank=1, world_size=2, seed=3)
    for _ in range(40):
        for x, y in loader.next_batch():
            assert x.shape == (16, seq) and torch.equal(x, y)
            first = x[:, 0]
            assert torch.equal(x, first[:, None] + torch.arange(seq))  # whole, right rows
    grown = _rss_anon() - before
    loader.close()
    # reading the split into memory would hold >= 128 MiB (256 MiB with labels); a rank here
    # holds two steps' rows (2 x 32 rows) and the epoch's permutation (512 KiB)
    assert grown < corpus / 4, f"anonymous memory grew {grown >> 20} MiB over 40 steps"
    assert loader.num_sequences == per_shard * n_shards
