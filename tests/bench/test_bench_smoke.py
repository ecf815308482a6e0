"""The prepare_data benchmark harness runs end to end at a tiny size and reports three ratios.

Only that the figures exist and are finite: whether they meet issue 3's targets is what
`make bench` (at full size) reports, not what this test checks.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
METRICS = (
    "throughput vs `encode_batch` floor",
    "throughput vs `datasets.map` + packing",
    "peak RSS",
)


def _results_table(markdown: str) -> dict[str, list[str]]:
    """The rows of the first table (the results) keyed by their metric cell."""
    rows: dict[str, list[str]] = {}
    lines = markdown.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| metric |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    assert header == ["metric", "ours", "peer", "ratio", "target", "result"]
    return rows


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_bench_reports_three_finite_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    cmd = [sys.executable, "-m", "bench.prepare_bench", "--quick", "--out", str(out)]
    cmd += ["--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = _results_table(out.read_text())
    assert len(rows) == 3
    for metric in METRICS:
        (row,) = [cells for name, cells in rows.items() if name.startswith(metric)]
        ratio = float(row[3])
        assert math.isfinite(ratio) and ratio > 0, row
        assert row[5] in ("pass", "FAIL"), row
    assert "| metric |" in proc.stdout  # the table is printed too
    assert "python -m bench.prepare_bench --quick" in out.read_text()  # the command to rerun
