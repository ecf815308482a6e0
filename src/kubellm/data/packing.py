"""Packing tokenized documents into fixed-length training rows.

Two strategies, both streaming (bounded buffers) and both reporting what they cost:

- `concat`: concatenate documents with EOS separators and cut every seq_len tokens. No
  padding; documents straddle rows; only the final tail (< seq_len tokens) is cropped.
- `best_fit`: documents are kept whole where they fit: within a window of documents, each
  goes into the open row with the least room that still holds it (best-fit decreasing);
  rows are padded (loss mask 0). A document longer than seq_len is split into seq_len
  pieces, so nothing is cropped.

A document is (ids, n_prompt): its first n_prompt tokens are not training targets; or
(ids, mask), a per-token int8 mask (1 = target) when several spans are trained (a chat's
assistant turns). The EOS each document is followed by is always a target.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

Doc = tuple[list[int], "int | np.ndarray"]


def is_masked(mask: int | np.ndarray) -> bool:
    """Whether a document's mask (n_prompt or per-token) leaves any of its tokens out."""
    return bool(mask) if isinstance(mask, int) else not bool(mask.all())


@dataclass
class Rows:
    ids: np.ndarray  # (n, seq_len) int32
    mask: np.ndarray  # (n, seq_len) int8, 1 = training target

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class PackStats:
    tokens: int = 0  # document tokens in (EOS included)
    padding: int = 0  # pad slots written
    cropped: int = 0  # document tokens not written

    def percentages(self, rows_tokens: int) -> dict[str, float]:
        return {
            "padding_pct": round(100.0 * self.padding / max(rows_tokens, 1), 4),
            "cropped_pct": round(100.0 * self.cropped / max(self.tokens, 1), 4),
        }


def concat_rows(parts: list[Rows]) -> Rows:
    """One Rows of several, in order."""
    return Rows(np.concatenate([r.ids for r in parts]), np.concatenate([r.mask for r in parts]))


def _flatten(docs: list[Doc], eos: int) -> tuple[np.ndarray, np.ndarray]:
    total = sum(len(ids) + 1 for ids, _ in docs)
    ids_out = np.empty(total, dtype=np.int32)
    mask_out = np.ones(total, dtype=np.int8)
    pos = 0
    for ids, n_prompt in docs:
        n = len(ids)
        ids_out[pos : pos + n] = ids
        ids_out[pos + n] = eos
        if isinstance(n_prompt, int):
            if n_prompt:
                mask_out[pos : pos + n_prompt] = 0
        else:
            mask_out[pos : pos + n] = n_prompt
        pos += n + 1
    return ids_out, mask_out


class ConcatPacker:
    def __init__(self, seq_len: int, eos: int) -> None:
        self.seq_len = seq_len
        self.eos = eos
        self.stats = PackStats()
        self._ids = np.empty(0, dtype=np.int32)
        self._mask = np.empty(0, dtype=np.int8)

    def add(self, docs: list[Doc]) -> Rows:
        return self.add_flat(*_flatten(docs, self.eos))

    def add_flat(self, ids: np.ndarray, mask: np.ndarray | None = None) -> Rows:
        """Documents already concatenated, each followed by its EOS; mask None: all targets."""
        if mask is None:
            mask = np.ones(len(ids), dtype=np.int8)
        self.stats.tokens += len(ids)
        ids = np.concatenate([self._ids, ids])
        mask = np.concatenate([self._mask, mask])
        n = len(ids) // self.seq_len
        cut = n * self.seq_len
        self._ids, self._mask = ids[cut:], mask[cut:]
        return Rows(ids[:cut].reshape(n, self.seq_len), mask[:cut].reshape(n, self.seq_len))

    def finish(self) -> Rows:
        self.stats.cropped += len(self._ids)
        self._ids = np.empty(0, dtype=np.int32)
        self._mask = np.empty(0, dtype=np.int8)
        return Rows(np.empty((0, self.seq_len), np.int32), np.empty((0, self.seq_len), np.int8))


class BestFitPacker:
    def __init__(self, seq_len: int, eos: int, pad: int, window: int = 8192) -> None:
        self.seq_len = seq_len
        self.eos = eos
        self.pad = pad
        self.window = window
        self.stats = PackStats()
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, docs: list[Doc]) -> Rows:
        for ids, n_prompt in docs:
            seq = np.asarray([*ids, self.eos], dtype=np.int32)
            mask = np.ones(len(seq), dtype=np.int8)
            if isinstance(n_prompt, int):
                mask[:n_prompt] = 0
            else:
                mask[: len(ids)] = n_prompt
            self.stats.tokens += len(seq)
            for start in range(0, len(seq), self.seq_len):  # long documents: seq_len pieces
                self._pending.append(
                    (seq[start : start + self.seq_len], mask[start : start + self.seq_len])
                )
        if len(self._pending) < self.window:
            return self._empty()
        return self._pack()

    def finish(self) -> Rows:
        return self._pack() if self._pending else self._empty()

    def _empty(self) -> Rows:
        return Rows(np.empty((0, self.seq_len), np.int32), np.empty((0, self.seq_len), np.int8))

    def _pack(self) -> Rows:
        pieces = sorted(self._pending, key=lambda p: -len(p[0]))  # stable: deterministic
        self._pending = []
        bins: list[list[int]] = []  # piece indices per row
        room: list[tuple[int, int]] = []  # sorted (free slots, row index)
        for i, (ids, _) in enumerate(pieces):
            k = bisect.bisect_left(room, (len(ids), -1))
            if k < len(room):
                free, row = room.pop(k)
                bins[row].append(i)
                bisect.insort(room, (free - len(ids), row))
            else:
                bins.append([i])
                bisect.insort(room, (self.seq_len - len(ids), len(bins) - 1))
        out_ids = np.full((len(bins), self.seq_len), self.pad, dtype=np.int32)
        out_mask = np.zeros((len(bins), self.seq_len), dtype=np.int8)
        for row, members in enumerate(bins):
            pos = 0
            for i in members:
                ids, mask = pieces[i]
                out_ids[row, pos : pos + len(ids)] = ids
                out_mask[row, pos : pos + len(ids)] = mask
                pos += len(ids)
            self.stats.padding += self.seq_len - pos
        return Rows(out_ids, out_mask)


def make_packer(strategy: str, seq_len: int, eos: int, pad: int) -> ConcatPacker | BestFitPacker:
    if strategy == "concat":
        return ConcatPacker(seq_len, eos)
    if strategy == "best_fit":
        return BestFitPacker(seq_len, eos, pad)
    raise ValueError(f"packing={strategy!r}: allowed 'concat', 'best_fit'")
