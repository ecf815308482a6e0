"""The trainer seam: run a TrainJob to completion on some launcher."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kubellm.jobs import JobResult, TrainJob


class Trainer(ABC):
    """Runs one training job and returns its logs and metrics, or raises JobFailed."""

    @abstractmethod
    def run(self, job: TrainJob) -> JobResult: ...
