"""What every benchmark report says about where it ran: machine, versions, commit."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def machine_info(packages: tuple[str, ...]) -> dict[str, str]:
    """Date, CPUs, memory, Python and `packages` versions, the kubellm source and git HEAD.

    "git HEAD" is `git_commit()`: the short hash, with "-dirty" when src/ or bench/ has
    uncommitted changes (the figures are then not those of the commit).
    """
    info = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": platform.processor() or platform.machine(),
        "memory": "?",
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        info["memory"] = f"{kib / (1 << 20):.1f} GiB"
    for pkg in packages:
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = "not installed"
    import kubellm

    info["kubellm source"] = str(Path(kubellm.__file__).resolve().parent)
    commit = git_commit()
    if commit:
        info["git HEAD"] = commit
    return info


def git_commit() -> str:
    """`git rev-parse --short HEAD`, plus "-dirty" when src/ or bench/ has uncommitted changes.

    The figures of a dirty tree are not those of the commit: the mark says so. "" outside a
    git checkout.
    """
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        if rev.returncode == 0:
            status = subprocess.run(
                ["git", "status", "--porcelain", "--", "src", "bench"],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            dirty = status.returncode != 0 or bool(status.stdout.strip())
            return rev.stdout.strip() + ("-dirty" if dirty else "")
    return ""
