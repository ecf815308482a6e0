"""Near-duplicate detection: near copies collide, unrelated texts do not."""

from __future__ import annotations

import random

from kubellm.data.minhash import NearDuplicates, choose_bands


def _text(seed: int, n: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(
        rng.choice(
            [
                "alpha",
                "beta",
                "gamma",
                "delta",
                "eps",
                "zeta",
                "eta",
                "theta",
                "iota",
                "kappa",
                "lambda",
                "mu",
            ]
        )
        + str(rng.randint(0, 50))
        for _ in range(n)
    )


def test_near_copy_is_caught_and_unrelated_texts_pass() -> None:
    nd = NearDuplicates(threshold=0.8)
    base = _text(1)
    assert not nd.is_duplicate(base)
    words = base.split()
    words[60] = "changed"  # one word of 120: Jaccard of 5-gram sets stays high
    assert nd.is_duplicate(" ".join(words))
    assert sum(nd.is_duplicate(_text(s)) for s in range(2, 52)) == 0


def test_signatures_are_stable_across_instances() -> None:
    a, b = NearDuplicates(0.8, seed=3), NearDuplicates(0.8, seed=3)
    assert (a.signature("some text here") == b.signature("some text here")).all()


def test_band_choice_tracks_the_threshold() -> None:
    b_lo, r_lo = choose_bands(128, 0.5)
    b_hi, r_hi = choose_bands(128, 0.9)
    assert b_lo * r_lo == 128 and b_hi * r_hi == 128
    assert r_hi > r_lo  # stricter threshold: more rows per band
