"""The Slurm tests' fixtures: a real Slurm for the session (tests/slurm/cluster.py) and the
tiny dataset the training tests use."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurmkit import SlurmCluster, missing_binaries

from kubellm.data.prepare import PrepareParams, prepare


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd on localhost; $SLURM_CONF points at it while it runs.

    Its directory is under /tmp, not pytest's tmp_path: munged wants every directory above
    its socket searchable by all, and job steps (root) must reach the job scripts."""
    missing = missing_binaries()
    if missing:
        pytest.fail(
            f"Slurm is not installed ({', '.join(missing)} missing): run `make slurm-deps`",
            pytrace=False,
        )
    root = Path(tempfile.mkdtemp(prefix="kubellm-slurm-"))
    root.chmod(0o755)
    cluster = SlurmCluster(root)
    before = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,000 synthetic records, BPE vocab 300, rows of 16 tokens (as tests/train's)."""
    out = tmp_path_factory.mktemp("tiny-ds")
    prepare(PrepareParams(num_records=2000, vocab_size=300, seq_len=16), out)
    return out
