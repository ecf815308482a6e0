"""Comparing greedy answers that came by different routes (batched, served, in-process).

Padding and batch size can change a logit's last bits, so two greedy runs may part where the
top two logits are within NEAR_TIE. Such differences are excused and reported (a pytest
warning, shown in the summary); any other difference fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

NEAR_TIE = 1e-4


class NearTie(UserWarning):
    """Two greedy answers differed where the model's top two logits were nearly tied."""


def assert_same_greedy(
    got: Sequence[str], expected: Sequence[tuple[str, float]], what: str
) -> list[int]:
    """`got[i]` equals `expected[i][0]` unless `expected[i][1]` (that answer's smallest
    top1-top2 logit gap) is a near-tie; returns the indices excused."""
    assert len(got) == len(expected), (what, got, expected)
    excused = []
    for i, (answer, (reference, gap)) in enumerate(zip(got, expected, strict=True)):
        if answer == reference:
            continue
        assert gap < NEAR_TIE, f"{what}[{i}]: {answer!r} != {reference!r} (logit gap {gap:.3g})"
        excused.append(i)
        warnings.warn(
            f"{what}[{i}] differs at a near-tie (gap {gap:.2e}): {answer!r} vs {reference!r}",
            NearTie,
            stacklevel=2,
        )
    return excused
