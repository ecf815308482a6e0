"""The bench tests' shared fixture: the quick benchmark runs (quick_runs.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from quick_runs import HARNESSES, BenchRuns


@pytest.fixture(scope="session")
def bench_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BenchRuns]:
    """Starts the quick run of every bench test collected (`pytest.mark.bench_run(name)`)."""
    wanted = {m.args[0] for item in request.session.items for m in item.iter_markers("bench_run")}
    runs = BenchRuns(tmp_path_factory)
    for name in HARNESSES:  # the order they start in; serve last
        if name in wanted:
            runs.start(name)
    try:
        yield runs
    finally:
        runs.close()
