"""Pre-emption: SIGTERM (Kubernetes) and SIGUSR1 (Slurm's warning) end training cleanly.

The handler only sets a flag. After each optimizer step the ranks agree on it (one tiny
all-reduce, so a signal that reached a single rank stops them all at the same step), write a
checkpoint and exit with EXIT_PREEMPTED.

EXIT_PREEMPTED is 200: inside the 128-255 range that the Training Operator's
`restartPolicy: ExitCode` treats as retryable (the pod is restarted and resumes from the
checkpoint), while real errors exit 1 (a crash) or 2 (bad config or data) and are not
retried. It is not 128+N for any common signal, so it is never mistaken for a process that
was killed before it could checkpoint.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 200
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Installs the handlers on enter, restores the previous ones on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def requested(self, device: torch.device) -> bool:
        """True on every rank when any rank got a signal (collective when distributed)."""
        flag = torch.tensor([1 if self.received is not None else 0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a peer rank"
