"""The bench tests' shared fixture: the quick benchmark runs (quick_runs.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from quick_runs import BenchRuns


@pytest.fixture(scope="session")
def bench_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BenchRuns]:
    """Starts the quick run of every bench test collected (`pytest.mark.bench_run(name)`)."""
    yield from BenchRuns(tmp_path_factory).started(request.session, "bench_run")
