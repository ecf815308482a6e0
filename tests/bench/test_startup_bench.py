"""The start-up memory benchmark runs end to end at a tiny size and reports every run.

Only that the figures exist and add up: whether kubellm meets the target is what
`make bench-startup` (a ~1B model) reports, not what this test checks (at this size the
interpreter, not the model, is the memory)."""

from __future__ import annotations

import pytest
from quick_runs import BenchRuns

RUNS = (
    "kubellm LoRA bf16",
    "kubellm LoRA fp32",
    "kubellm full bf16",
    "naive from_pretrained LoRA bf16",
)


@pytest.mark.timeout(2400)  # it waits for the batch's runs too
@pytest.mark.bench_run("startup")
def test_quick_startup_bench_reports_every_run(bench_runs: BenchRuns) -> None:
    # python -m bench.startup_bench --quick --out startup.md (tests/bench/conftest.py)
    run = bench_runs.result("startup")
    proc, out = run.proc, run.tmp / "startup.md"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {
        cells[0]: cells
        for line in out.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| run")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == set(RUNS), rows
    for name, cells in rows.items():
        start_up = [float(v) for v in cells[1].split(",")]
        end = [float(v) for v in cells[4].split(",")]
        assert len(start_up) == len(end) == 2, name  # both ranks report
        assert abs(sum(start_up) - float(cells[2])) < 0.02, name
        assert all(e >= s > 0.1 for s, e in zip(start_up, end, strict=True)), name
    assert rows["kubellm LoRA bf16"][8] in ("PASS", "FAIL")  # the target row is judged
