"""What every launcher shares: a job description, its result, and how it fails.

A job is one run of the training entrypoint (`python -m kubellm.train ARGS`), whatever starts
it: torchrun on this machine, a PyTorchJob, a Katib trial. Launchers differ; the contract
does not: a job that does not succeed raises, with the reason, and never hangs past its
timeout.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Katib's StdOut metrics collector finds `name=value` pairs in each line (its default filter
# `([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)`); we read the same lines the same way.
_METRIC_PAIR = re.compile(
    r"(?:^|\s)([A-Za-z_][\w./-]*)=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?=\s|$)"
)


class JobFailed(RuntimeError):
    """A job reached a failed terminal state; the message carries its reason."""


class JobTimeout(JobFailed):
    """A job did not finish in time; it has been deleted (or killed)."""


@dataclass(frozen=True)
class TrainJob:
    """One run of `python -m <module>` (the training entrypoint by default) on some launcher.

    `module` is also `kubellm.preflight.fabric`: preflight's fabric check runs with the
    training topology on the same launcher.
    """

    name: str
    train_args: list[str]
    module: str = "kubellm.train"
    nnodes: int = 1
    nproc_per_node: int = 1
    timeout_s: float = 3600.0
    image: str = ""
    namespace: str = "default"
    env: dict[str, str] = field(default_factory=dict)
    workspace_pvc: str | None = None
    gpus_per_node: int = 0
    # torchrun restarts the worker group this many times after a worker dies (local runs;
    # on a cluster the PyTorchJob's ExitCode restart policy and backoffLimit do this).
    max_restarts: int = 0


@dataclass(frozen=True)
class JobResult:
    name: str
    logs: str
    metrics: dict[str, float]


def parse_metrics(text: str) -> dict[str, float]:
    """The last value of each metric in `name=value` pairs of `text` (several per line allowed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name, raw in _METRIC_PAIR.findall(line):
            value = float(raw)
            if math.isfinite(value):
                out[name] = value
    return out


def format_metrics(metrics: dict[str, float]) -> str:
    """One metric line as the trainer prints it: `name=value name=value ...`."""
    return " ".join(f"{k}={v:.6g}" for k, v in metrics.items())


def dns_name(*parts: str, max_len: int = 52) -> str:
    """A DNS-1123 label from parts (Kubernetes object names; Katib needs room for suffixes)."""
    raw = "-".join(p for p in parts if p).lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")
    name = re.sub(r"-{2,}", "-", name)[:max_len].strip("-")
    if not name:
        raise ValueError(f"cannot make a Kubernetes name from {parts!r}")
    return name
