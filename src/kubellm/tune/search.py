"""The vocabulary of a hyperparameter search, shared by optuna and Katib: parameters, trials.

A trial is a training run with `--set name=value` per sampled parameter, so the search space
needs nothing from the tuner that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class SearchParam:
    """One hyperparameter; trials pass it to the trainer as `--set name=value`."""

    name: str
    low: float
    high: float
    log: bool = False
    kind: Literal["double", "int"] = "double"


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
