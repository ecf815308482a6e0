"""Rank 0's training metrics to MLflow, without ever holding up a step.

A training step must not wait for the tracking server: a slow or restarting server would
stall every rank (they wait for rank 0 at the next collective), and an exception from the
client would kill the run with a non-retryable exit 1. So `MlflowSink.log` only appends to
a bounded buffer, and one sender thread drains it with `log_batch` (up to 1,000 points a
call, MLflow's limit), retrying with exponential backoff while the server is away. When
the buffer is full the oldest points go first, counted. `close` gives the sender a deadline
to flush, counts what it could not send as dropped, and returns both counts, which the
trainer prints (and logs, when the server takes it).

The client's own retries are turned off in this process (the sender has its own, which
never block training), and each request has a short timeout, unless the environment
already sets them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

BATCH = 1000  # MLflow's log_batch limit on metrics per call
CAPACITY = 100_000  # points buffered while the server is away (~20 bytes each)
BACKOFF_MAX_S = 30.0


@dataclass(frozen=True)
class SinkReport:
    sent: int
    dropped: int
    last_error: str


class MlflowSink:
    """Buffered, non-blocking `log(metrics, step)` to one MLflow run (a no-op without one)."""

    def __init__(
        self,
        uri: str,
        run_id: str,
        *,
        capacity: int = CAPACITY,
        backoff_max_s: float = BACKOFF_MAX_S,
        client: Any = None,
    ) -> None:
        self.run_id = run_id
        self.capacity = capacity
        self.backoff_max_s = backoff_max_s
        self._buffer: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._deadline = float("inf")
        self.sent = 0
        self.dropped = 0
        self.last_error = ""
        self.client = client
        if self.client is None and uri and run_id:
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=uri)
        self._thread: threading.Thread | None = None
        if self.client is not None:
            from mlflow.entities import Metric  # here: importing mlflow takes a second

            self._metric = Metric
            self._thread = threading.Thread(target=self._send, name="mlflow-sink", daemon=True)
            self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue the points; never blocks, never raises for the server's sake."""
        if self._thread is None:
            return
        now = int(time.time() * 1000)
        with self._cond:
            for k, v in metrics.items():
                self._buffer.append(self._metric(k, float(v), now, step))
            while len(self._buffer) > self.capacity:
                self._buffer.popleft()
                self.dropped += 1
            self._cond.notify()

    def _send(self) -> None:
        delay = 1.0
        while True:
            with self._cond:
                while not self._buffer and not self._closing:
                    self._cond.wait()
                if not self._buffer:
                    return  # closing, all sent
                batch = [self._buffer[i] for i in range(min(BATCH, len(self._buffer)))]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as err:  # the server is away, or refused the batch
                self.last_error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                with self._cond:
                    if time.monotonic() + delay > self._deadline:
                        return  # close() counts what is left as dropped
                    self._cond.wait(timeout=delay)
                delay = min(delay * 2, self.backoff_max_s)
                continue
            delay = 1.0
            with self._cond:
                for m in batch:  # log() may have dropped the oldest meanwhile
                    if self._buffer and self._buffer[0] is m:
                        self._buffer.popleft()
                self.sent += len(batch)

    def close(self, timeout_s: float = 60.0) -> SinkReport:
        """Flush for at most `timeout_s`; what is still buffered then counts as dropped."""
        if self._thread is not None:
            with self._cond:
                self._closing = True
                self._deadline = time.monotonic() + timeout_s
                self._cond.notify_all()
            self._thread.join(timeout_s + 1.0)
            with self._cond:
                self.dropped += len(self._buffer)
                self._buffer.clear()
            self._thread = None
        return SinkReport(self.sent, self.dropped, self.last_error)
