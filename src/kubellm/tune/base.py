"""The tuner seam: a search space, trials that are training jobs, one objective."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from kubellm.jobs import TrainJob


@dataclass(frozen=True)
class SearchParam:
    """One hyperparameter; trials pass it to the trainer as `--set name=value`."""

    name: str
    low: float
    high: float
    log: bool = False
    kind: Literal["double", "int"] = "double"


@dataclass(frozen=True)
class TuneRequest:
    name: str
    trial_job: TrainJob  # the template; each trial appends `--set name=value` per parameter
    space: list[SearchParam]
    max_trials: int
    objective: str = "eval_loss"
    goal: Literal["minimize", "maximize"] = "minimize"
    parallel_trials: int = 1
    seed: int = 0
    timeout_s: float = 3600.0


@dataclass
class Trial:
    name: str
    params: dict[str, float]
    value: float | None
    state: str  # "succeeded" | "failed"


@dataclass
class TuneResult:
    best_params: dict[str, float]
    best_value: float
    best_trial: str
    trials: list[Trial] = field(default_factory=list)


def trial_args(base: list[str], params: dict[str, float], space: list[SearchParam]) -> list[str]:
    """The trainer arguments of one trial: the template's, then one `--set` per parameter."""
    kinds = {p.name: p.kind for p in space}
    out = list(base)
    for name, value in params.items():
        shown = str(int(value)) if kinds.get(name) == "int" else repr(float(value))
        out += ["--set", f"{name}={shown}"]
    return out


class Tuner(ABC):
    @abstractmethod
    def tune(self, request: TuneRequest) -> TuneResult: ...
