"""The trainer's MLflow sink: a bounded buffer and a sender thread, so the tracking server
can be slow, down or restarting without holding up a step or failing the run."""

from __future__ import annotations

import threading
import time
from typing import Any

from kubellm.train.metrics_sink import MlflowSink


class FlakyClient:
    """A stand-in for MlflowClient.log_batch: down until `up` is set, then records."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.received: list[tuple[str, int]] = []
        self.calls = 0

    def log_batch(self, run_id: str, metrics: list[Any]) -> None:
        self.calls += 1
        if not self.up.is_set():
            raise ConnectionError("connection refused")
        self.received += [(m.key, m.step) for m in metrics]


def test_a_server_outage_never_blocks_a_step_and_loses_nothing_it_can_hold() -> None:
    client = FlakyClient()
    sink = MlflowSink("", "run", client=client, backoff_max_s=0.2)
    began = time.perf_counter()
    for step in range(1, 501):
        sink.log({"loss": 1.0 / step, "lr": 0.1}, step)
    assert time.perf_counter() - began < 1.0  # 1,000 points queued while the server is down
    time.sleep(0.3)
    assert client.calls >= 1 and client.received == []  # it tried, and keeps them
    client.up.set()
    report = sink.close(timeout_s=10)
    assert report.dropped == 0 and report.sent == 1000
    assert client.received == [(k, s) for s in range(1, 501) for k in ("loss", "lr")]  # in order


def test_a_full_buffer_drops_the_oldest_points_and_counts_them() -> None:
    client = FlakyClient()
    sink = MlflowSink("", "run", client=client, capacity=10, backoff_max_s=0.1)
    for step in range(25):
        sink.log({"loss": float(step)}, step)
    client.up.set()
    report = sink.close(timeout_s=10)
    assert report.dropped == 15 and report.sent == 10
    assert [s for _, s in client.received] == list(range(15, 25))  # the newest kept


def test_close_gives_up_at_its_deadline_and_counts_what_is_left() -> None:
    client = FlakyClient()  # never comes back
    sink = MlflowSink("", "run", client=client, backoff_max_s=0.1)
    sink.log({"loss": 1.0, "lr": 0.1}, 1)
    began = time.monotonic()
    report = sink.close(timeout_s=1.0)
    assert time.monotonic() - began < 3.0
    assert report.sent == 0 and report.dropped == 2
    assert "ConnectionError: connection refused" in report.last_error


def test_without_a_run_it_is_a_no_op() -> None:
    sink = MlflowSink("", "")
    sink.log({"loss": 1.0}, 1)
    assert sink.close().sent == 0
