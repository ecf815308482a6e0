"""The training-throughput benchmark runs its three contenders end to end at a tiny size.

Only that every contender ran, trained and was measured: positive tokens/s on both clocks,
finite losses, the two ratio rows. Whether kubellm meets issue 4's targets is what
`make bench` (at full size) reports, not what this test checks: at this size, on a shared
machine, the ratios are noise.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTENDERS = ("kubellm.train", "HF Trainer", "minimal DDP loop")


def _table(markdown: str, first_header: str) -> tuple[list[str], dict[str, list[str]]]:
    """(header cells, rows keyed by their first cell) of the table starting with that header."""
    lines = markdown.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_header} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return header, rows


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_train_bench_measures_three_contenders(tmp_path: Path) -> None:
    out, figures = tmp_path / "train-bench.md", tmp_path / "train-bench.json"
    cmd = [sys.executable, "-m", "bench.train_bench", "--quick", "--out", str(out)]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "--json", str(figures)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = out.read_text()

    header, results = _table(md, "metric")
    assert header == ["metric", "kubellm", "peer", "ratio", "target", "result"]
    assert len(results) == 2
    for name, target in (
        ("tokens/s vs HF Trainer", "≥ 1.0"),
        ("tokens/s vs minimal DDP", "≥ 0.95"),
    ):
        (row,) = [cells for key, cells in results.items() if key.startswith(name)]
        assert _number(row[1]) > 0 and _number(row[2]) > 0, row
        ratio = float(row[3])
        assert math.isfinite(ratio) and ratio > 0, row
        assert math.isclose(ratio, _number(row[1]) / _number(row[2]), rel_tol=0.01), row
        assert row[4] == target and row[5] in ("pass", "FAIL"), row

    header, runs = _table(md, "contender")
    assert set(runs) == set(CONTENDERS)
    loss_col = header.index("final loss, per run")
    for name in CONTENDERS:
        assert _number(runs[name][header.index("best")]) > 0, runs[name]
        assert math.isfinite(float(runs[name][loss_col])), runs[name]

    data = json.loads(figures.read_text())
    by_name = {r["contender"]: r for r in data["runs"]}
    assert set(by_name) == {"kubellm", "hf_trainer", "ddp_loop"}
    for run in by_name.values():
        assert run["tokens_per_sec"] > 0 and run["parent_tokens_per_sec"] > 0, run
        assert math.isfinite(run["loss"]) and 0 < run["loss"] < 20, run
    # Same initial weights, same rows in the same order, same optimizer: kubellm and the
    # hand-written loop train the same thing, so their last losses agree.
    assert math.isclose(by_name["kubellm"]["loss"], by_name["ddp_loop"]["loss"], rel_tol=0.02)

    assert "| metric |" in proc.stdout  # the table is printed too
    assert "python -m bench.train_bench --quick" in md  # the command to rerun
