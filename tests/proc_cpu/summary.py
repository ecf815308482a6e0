"""CPU seconds by kind of process from a log that sitecustomize.py wrote.

python tests/proc_cpu/summary.py LOG [--tests N]
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

# (kind, test on the argv joined by spaces and the script's name); the first that holds
KINDS = (
    ("KFP pipeline steps", lambda s, b: "executor_main" in b),
    ("training ranks", lambda s, b: "--config" in s and ("train" in s or b == "__main__.py")),
    ("torchrun agents", lambda s, b: b in ("run.py", "agent.py", "torchrun")),
    ("pip", lambda s, b: " install " in f" {s} " and "pip" in s),
    ("pytest processes", lambda s, b: b == "__main__.py" and " -p " in f" {s} "),
    (
        "model servers",
        lambda s, b: "serve/__main__.py" in s or " serve " in f" {s} " or "bare_http" in b,
    ),
    ("mlflow servers", lambda s, b: "mlflow" in s and ("server" in s or "uvicorn" in s)),
)


def kind(argv: list[str]) -> str:
    script = os.path.basename(argv[0]) if argv else ""
    joined = " ".join(argv)
    return next((name for name, holds in KINDS if holds(joined, script)), "other")


def summarize(lines: list[dict], tests: int) -> str:
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_test: dict[str, float] = defaultdict(float)
    for line in lines:
        row = by_kind[kind(line["argv"])]
        row[0] += 1
        row[1] += line["cpu"]
        by_test[line["test"].split(" ")[0] or "(no test)"] += line["cpu"]
    total = sum(cpu for _, cpu in by_kind.values()) or 1.0
    out = [f"{len(lines)} processes, {total:,.0f} CPU-s", ""]
    out += ["| processes | count | CPU-s | share |", "|---|---:|---:|---:|"]
    for name, (n, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        out.append(f"| {name} | {n:.0f} | {cpu:,.0f} | {100 * cpu / total:.0f} % |")
    out += ["", "CPU-s of the processes each test started:"]
    for test, cpu in sorted(by_test.items(), key=lambda kv: -kv[1])[:tests]:
        out.append(f"{cpu:8.1f}  {test}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--tests", type=int, default=20, help="the tests with the most CPU to list")
    args = ap.parse_args()
    lines = [json.loads(t) for t in args.log.read_text().splitlines() if t.strip()]
    print(summarize(lines, args.tests))


if __name__ == "__main__":
    main()
