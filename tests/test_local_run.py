"""What `kubellm run --local` puts on the terminal (the rest goes to the log file)."""

from __future__ import annotations

import pytest

from kubellm.commands.local_run import shown


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("kubellm: train started\n", "kubellm: train started"),
        (
            "  [kubellm-tiny-train-1] train: 150/1500 steps (10%)",
            "[kubellm-tiny-train-1] train: 150/1500 steps (10%)",
        ),
        (
            "\x1b[91m12:00 - ERROR - Task 'preflight' finished with status FAILURE\x1b[0m",
            "12:00 - ERROR - Task 'preflight' finished with status FAILURE",
        ),
        # the reason a task failed: the last line of its traceback
        (
            "    kubellm.tracking.TrackingUnavailable: MLflow tracking server http://h:9 is down",
            "kubellm.tracking.TrackingUnavailable: MLflow tracking server http://h:9 is down",
        ),
        (
            "kubellm.data.records.DataError: data source 'x' matches no file",
            "kubellm.data.records.DataError: data source 'x' matches no file",
        ),
        ("RuntimeError: CUDA out of memory", "RuntimeError: CUDA out of memory"),
        # noise stays in the log
        ("    raise ConfigError(msg)", None),
        ('  File "/x/y.py", line 3, in <module>', None),
        ("UserWarning: something deprecated", None),
        ("[KFP Executor 2026-11-30 INFO]: Looking for component", None),
    ],
)
def test_shown(line: str, expected: str | None) -> None:
    assert shown(line) == expected
