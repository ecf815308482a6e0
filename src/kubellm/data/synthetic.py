"""A built-in dataset a tiny model learns in a minute: two-number addition as text.

Why addition: held-out questions have one right answer, so exact-match accuracy on unseen
pairs shows real learning (chance is about 1/100), and the records are generated from a seed,
so every run and every test sees the same data without a download.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def arithmetic_records(n: int, seed: int = 0, max_operand: int = 99) -> Iterator[dict[str, str]]:
    """`n` records {"prompt": "a+b=", "completion": "c", "text": "a+b=c"} in a seeded order.

    Pairs repeat once n exceeds the (max_operand+1)^2 distinct ones; prepare_data's exact
    dedup then drops and counts the repeats, as it would for real data.
    """
    rng = random.Random(seed)
    for _ in range(n):
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_operand)
        prompt = f"{a}+{b}="
        completion = str(a + b)
        yield {"prompt": prompt, "completion": completion, "text": prompt + completion}
