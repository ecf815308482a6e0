"""Near-duplicate detection with MinHash and LSH banding (optional; off by default).

Each document's word 5-gram shingles (character 5-grams for short texts) are hashed with
CRC32 (stable across processes, unlike Python's `hash`), min-hashed under `num_perm`
universal hash functions, and cut into bands; a document that shares any band with an
earlier one is a near duplicate. Bands and rows are chosen so the LSH S-curve's midpoint
(1/bands)^(1/rows) is closest to the Jaccard threshold asked for.
"""

from __future__ import annotations

import zlib

import numpy as np

_PRIME = (1 << 31) - 1


def choose_bands(num_perm: int, threshold: float) -> tuple[int, int]:
    """(bands, rows) with bands*rows == num_perm whose S-curve midpoint is nearest threshold."""
    options = [(b, num_perm // b) for b in range(1, num_perm + 1) if num_perm % b == 0]
    return min(options, key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - threshold))


def shingles(text: str, n: int = 5) -> set[str]:
    words = text.split()
    if len(words) >= n:
        return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}
    return {text[i : i + n] for i in range(max(1, len(text) - n + 1))}


class NearDuplicates:
    def __init__(self, threshold: float = 0.8, num_perm: int = 128, seed: int = 0) -> None:
        if not 0 < threshold < 1:
            raise ValueError(f"near_dedup_threshold={threshold}: allowed 0 < t < 1")
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, _PRIME, size=num_perm, dtype=np.uint64)
        self.b = rng.integers(0, _PRIME, size=num_perm, dtype=np.uint64)
        self.bands, self.rows = choose_bands(num_perm, threshold)
        self._seen: set[bytes] = set()

    def signature(self, text: str) -> np.ndarray:
        hashes = np.fromiter(
            (zlib.crc32(s.encode()) % _PRIME for s in shingles(text)), dtype=np.uint64
        )
        return ((self.a[:, None] * hashes[None, :] + self.b[:, None]) % _PRIME).min(axis=1)

    def is_duplicate(self, text: str) -> bool:
        """True when `text` collides with an earlier document in some band; else remember it."""
        sig = self.signature(text).astype(np.uint32)
        keys = [
            bytes([band]) + sig[band * self.rows : (band + 1) * self.rows].tobytes()
            for band in range(self.bands)
        ]
        if any(k in self._seen for k in keys):
            return True
        self._seen.update(keys)
        return False
