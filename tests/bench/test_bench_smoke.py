"""The prepare_data benchmark harness runs end to end at a tiny size and reports its ratios
for each corpus (clean, messy and the short-record one of issue 21).

Only that the figures exist and are finite: whether they meet the targets is what
`make bench` (at full size) reports, not what this test checks.
"""

from __future__ import annotations

import math

import pytest
from quick_runs import BenchRuns

METRICS = (
    "throughput vs tokenizer floor",
    "whole `kubellm prepare` process vs tokenizer floor",
    "throughput vs `datasets.map` + packing",
    "peak RSS",
)
NO_MEMORY = ("short",)  # corpora whose peak memory is not measured (the last metric)


def _results_tables(markdown: str) -> list[dict[str, list[str]]]:
    """The rows of each per-corpus results table, keyed by their metric cell."""
    tables: list[dict[str, list[str]]] = []
    lines = markdown.splitlines()
    for start, line in enumerate(lines):
        if not line.startswith("| metric |"):
            continue
        header = [c.strip() for c in line.strip("|").split("|")]
        assert header == ["metric", "ours", "peer", "ratio", "target", "result"]
        rows: dict[str, list[str]] = {}
        for row in lines[start + 2 :]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip("|").split("|")]
            rows[cells[0]] = cells
        tables.append(rows)
    return tables


@pytest.mark.slow
@pytest.mark.timeout(2400)  # it waits for the batch's runs too
@pytest.mark.bench_run("prepare")
def test_quick_bench_reports_three_finite_ratios_per_corpus(bench_runs: BenchRuns) -> None:
    # python -m bench.prepare_bench --quick --out bench.md (tests/bench/conftest.py)
    run = bench_runs.result("prepare")
    proc, out = run.proc, run.tmp / "bench.md"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    text = out.read_text()
    tables = _results_tables(text)
    assert len(tables) == 3  # the clean, messy and short corpora, in that order
    for kind, rows in zip(("clean", "messy", "short"), tables, strict=True):
        metrics = METRICS[:-1] if kind in NO_MEMORY else METRICS
        assert len(rows) == len(metrics), (kind, list(rows))
        for metric in metrics:
            (row,) = [cells for name, cells in rows.items() if name.startswith(metric)]
            ratio = float(row[3])
            assert math.isfinite(ratio) and ratio > 0, row
            assert row[5] in ("pass", "FAIL", "—"), row  # —: a ratio without a target
    assert "## The clean corpus" in text and "## The messy corpus" in text
    assert "## The short corpus" in text and "The start-up probe" in text
    assert "gives `encode_batch`'s ids, document by document: yes" in text
    assert "| metric |" in proc.stdout  # the tables are printed too
    assert "python -m bench.prepare_bench --quick" in text  # the command to rerun
    assert "at commit " in text
