"""The training tests' shared fixture: one tiny dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubellm.data.prepare import PrepareParams, prepare


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,000 synthetic records, BPE vocab 300, rows of 16 tokens (prompt tokens masked)."""
    out = tmp_path_factory.mktemp("tiny-ds")
    prepare(PrepareParams(num_records=2000, vocab_size=300, seq_len=16), out)
    return out
