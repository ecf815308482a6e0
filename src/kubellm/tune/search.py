"""The vocabulary of a hyperparameter search, shared by optuna and Katib: parameters, trials.

A trial is a training run with `--set name=value` per sampled parameter, so the search space
needs nothing from the tuner that runs it.
"""

from __future__ import annotations

import math
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


def grid_points(max_trials: int, n_params: int) -> int:
    """Points per parameter of a grid search of about `max_trials` points (at least 2)."""
    return max(2, math.ceil(max_trials ** (1 / max(1, n_params))))


def grid_step(p: SearchParam, points: int) -> float:
    """The spacing of `points` evenly spaced values from p.low to p.high (ints: >= 1).

    A grid is evenly spaced, also for parameters otherwise sampled log-uniformly (Katib's
    grid takes a `step`, not a distribution)."""
    if p.kind == "int":
        return float(max(1, int(p.high - p.low) // (points - 1)))
    return (p.high - p.low) / (points - 1)


def grid_values(p: SearchParam, points: int) -> list[float]:
    """The grid's values of `p`: low, low + step, ... up to high."""
    step = grid_step(p, points)
    n = math.floor((p.high - p.low) / step + 1e-9) + 1
    return [p.low + i * step for i in range(n)]
