"""The trainer's metric lines: `name=value` pairs on stdout, the one format every reader shares.

Katib's StdOut metrics collector finds `name=value` pairs in each line (its default filter
`([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)`); the local trainer and the PyTorchJob
launcher read the same lines the same way.
"""

from __future__ import annotations

import math
import re

_METRIC_PAIR = re.compile(
    r"(?:^|\s)([A-Za-z_][\w./-]*)=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?=\s|$)"
)


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
