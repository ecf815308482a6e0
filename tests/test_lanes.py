"""tests/lanes.py (`make test`): the two lanes are the whole suite, each test in one lane."""

from __future__ import annotations

import sys
from pathlib import Path

import lanes

REPO = Path(__file__).resolve().parents[1]


def test_lane_a_names_existing_paths_and_lane_b_is_the_rest() -> None:
    for path in lanes.LANE_A:
        assert (REPO / path).exists(), path  # a renamed directory must be renamed here too
    a, b = lanes.lanes(["-p", "no:cacheprovider"]).values()
    assert a[:3] == b[:3] == [sys.executable, "-m", "pytest"]
    assert a[3:5] == b[3:5] == ["-p", "no:cacheprovider"]  # ARGS go to both
    assert a[5:] == list(lanes.LANE_A)
    assert b[5] == "tests" and b[6:] == [f"--ignore={p}" for p in lanes.LANE_A]


def test_progress_is_the_last_percentage_of_the_log(tmp_path: Path) -> None:
    log = tmp_path / "lane.log"
    assert lanes._progress(log) == "collecting"
    log.write_text("tests/a.py ....    [  9%]\ntests/b.py ..F.   [ 42%]\n")
    assert lanes._progress(log) == "42%"
