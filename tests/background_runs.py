"""Named runs (each a few subprocesses) that a session starts together on a thread pool.

Shared by the e2e batch (tests/e2e/conftest.py) and the quick benchmark runs
(tests/bench/quick_runs.py): a test marks the runs it reads (`pytest.mark.<marker>(names)`),
the session fixture starts every run a collected test marks, in the subclass's order, and a
test's `result(name)` waits for its run (starting it first if nothing had).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest


class BackgroundRuns:
    """Subclasses define ORDER (every run's name, in the order they start) and `run(name)`."""

    ORDER: tuple[str, ...] = ()

    def __init__(self, parallel: int, prefix: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix=prefix)
        self._lock = threading.Lock()
        self.futures: dict[str, Future[Any]] = {}

    def run(self, name: str) -> Any:
        raise NotImplementedError

    def start(self, name: str) -> None:
        if name not in self.ORDER:
            raise KeyError(f"no run named {name!r} (runs: {', '.join(self.ORDER)})")
        with self._lock:
            if name not in self.futures:
                self.futures[name] = self._pool.submit(self.run, name)

    def result(self, name: str) -> Any:
        self.start(name)
        return self.futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def started(self, session: pytest.Session, marker: str) -> Iterator[Any]:
        """For a session fixture: starts the runs the collected tests mark, yields self,
        closes when the session ends."""
        wanted = {n for item in session.items for m in item.iter_markers(marker) for n in m.args}
        for name in self.ORDER:
            if name in wanted:
                self.start(name)
        try:
            yield self
        finally:
            self.close()
