"""Shared by the end-to-end tests: the small pipeline settings and the half-learnable data."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = {
    "num_records": 3000,
    "vocab_size": 300,
    "seq_len": 16,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "tune_trials": 2,
    "tune_steps": 8,
    "train_steps": 40,
    "batch_size": 8,
}
STAGES = {
    "preflight",
    "prepare_data",
    "tune",
    "train",
    "evaluate",
    "register",
    "deploy",
    "smoke_test",
}


# Half of these questions have a learnable answer (`abc?` -> `yes`), half a random one
# (`abc!` -> three random letters): the model's held-out exact match tops out near 0.5 by
# construction. With SMALL's model, 120 training steps reach 0.4-0.5 (measured 0.47 at 100
# steps by hand), so the default gate (0.2) promotes and 0.9 rejects: the gate is exercised
# where a real decision lies, not only at 0 and 1.
HALF_LEARNABLE_STEPS = 120
REJECT_ABOVE = 0.9


@pytest.fixture(scope="session")
def half_learnable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    path = tmp_path_factory.mktemp("data") / "half.jsonl"
    with path.open("w") as fh:
        for i in range(3000):
            word = "".join(rng.choice(letters) for _ in range(3))
            if i % 2 == 0:
                prompt, completion = f"{word}?", "yes"
            else:
                prompt, completion = f"{word}!", "".join(rng.choice(letters) for _ in range(3))
            fh.write(
                json.dumps(
                    {"text": prompt + completion, "prompt": prompt, "completion": completion}
                )
                + "\n"
            )
    return path
