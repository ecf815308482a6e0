"""Pre-emption: SIGTERM (Kubernetes) and SIGUSR1 (Slurm's warning) end training cleanly.

The handler only sets a flag. After each optimizer step every rank contributes its flag to
a one-element all-reduce (MAX) on a CPU (gloo) group of its own, started asynchronously and
read one step later: the ranks learn of a signal at the same step (even one that reached a
single rank), and the check never waits on the network or stalls a GPU's queue. They then
write a checkpoint and exit with EXIT_PREEMPTED, within two steps of the signal.

EXIT_PREEMPTED is 200: inside the 128-255 range that the Training Operator's
`restartPolicy: ExitCode` treats as retryable (the pod is restarted and resumes from the
checkpoint), while real errors exit 1 (a crash) or 2 (bad config or data) and are not
retried. It is not 128+N for any common signal, so it is never mistaken for a process that
was killed before it could checkpoint.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 200
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Installs the handlers on enter, restores the previous ones on exit."""

    def __init__(self, group: Any = None) -> None:
        self.received: int | None = None
        self.group = group  # a gloo group when distributed, None in a single process
        self._previous: dict[int, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __enter__(self) -> Preemption:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.drain()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def poll(self) -> bool:
        """True, on every rank at the same step, once any rank has been signalled."""
        if self.group is None:
            return self.received is not None
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        previous, self._pending = self._pending, (work, flag)
        if previous is None:
            return False
        previous[0].wait()
        return bool(previous[1].item())

    def drain(self) -> None:
        """Wait for the all-reduce in flight (before a checkpoint, or leaving the loop)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a peer rank"
