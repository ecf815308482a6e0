"""`kubellm run --local`: the compiled pipeline YAML on this machine, with kfp.local.

Two processes. The child runs the YAML (not the Python DSL) with kfp.local's
SubprocessRunner; everything it prints (executor inputs and outputs, every job's log,
tracebacks) goes to a log file under runs/logs/. The parent shows a person what matters:
one line as each stage starts and ends (name, seconds, key figure), the progress of long
steps (training steps, trials), the summary, and where the full log is.

    kubellm run --local --set train_steps=200
    kubellm run --local --from evaluate --to evaluate --input model=DIR --input dataset=DIR

`--from`/`--to` run a span of the stages instead (kubellm.commands.local_stages: built from
the components' Python source, so a changed component runs without `kubellm compile`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from kubellm.config import ConfigError, pipeline_config

# What reaches the terminal: our stage lines, training progress, trial results, kfp.local's
# word on a task that failed and the exception that failed it (the last line of its
# traceback: the reason, e.g. the unreachable tracking server's URI). Everything else
# stays in the log file.
_SHOWN = re.compile(
    r"^(kubellm: "
    r"|\[[\w.-]+\] train: \d+/\d+ steps"
    r"|\[[\w.-]+\] trial \d+"
    r"|.*finished with status FAILURE"
    r"|[\w.]*(Error|Unavailable|Failed|Exception): )"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def shown(line: str) -> str | None:
    """The line as the terminal shows it, or None when it belongs in the log file only."""
    text = _ANSI.sub("", line).strip()
    return text if _SHOWN.match(text) else None


def run_local(
    pipeline_yaml: str | Path,
    overrides: dict[str, Any],
    out: TextIO | None = None,
    span: dict[str, Any] | None = None,
) -> int:
    """Run the compiled YAML locally; returns an exit code (0: the pipeline succeeded).
    `span` ({"start", "stop", "inputs"}): run those stages of components/ instead (their
    inputs checked before anything starts). `out`: where a person reads it (stdout)."""
    out = sys.stdout if out is None else out  # at call time: a caller may have replaced it
    platform = overrides.get("platform", "local")
    if platform not in ("local", "slurm"):  # slurm: the steps here, training as sbatch jobs
        raise ConfigError(
            f"invalid platform={platform!r}: `run --local` runs platform 'local' or 'slurm'; "
            "use `kubellm submit` for a cluster"
        )
    cfg = pipeline_config(overrides, platform=platform)  # every value checked before any stage
    path = Path(pipeline_yaml)
    if span is not None:
        from kubellm.commands.local_stages import check_components, plan

        planned = plan(span["start"], span.get("stop"), span.get("inputs"))
        check_components()
    elif not path.is_file():
        raise ConfigError(f"pipeline {pipeline_yaml} not found (run `kubellm compile`)")
    runs = Path(cfg.runs_dir).resolve()
    root = runs / "kfp"
    root.mkdir(parents=True, exist_ok=True)
    logs = runs / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log"
    # typed as the pipeline declares them (an int given for a float parameter is a float)
    arguments = {k: getattr(cfg, k) for k in overrides}
    arguments.update(platform=platform, runs_dir=str(runs))
    what = str(path)
    module = "kubellm.commands.local_run"
    cmd = [sys.executable, "-m", module, str(path), str(root), json.dumps(arguments)]
    if span is not None:
        start, stop = planned.stages[0], planned.stages[-1]
        what = f"stages {start}..{stop} of components/"
        name = f"kubellm-{start}-{stop}-{time.strftime('%H%M%S')}".replace("_", "-")
        spec = {"start": start, "stop": stop, "inputs": planned.inputs}
        spec.update(name=name, arguments=arguments)
        cmd = [sys.executable, "-m", "kubellm.commands.local_stages", str(root), json.dumps(spec)]
    print(f"kubellm: running {what} locally; full log: {log_path}", file=out, flush=True)
    before = set(root.iterdir())
    started = time.monotonic()
    # component subprocesses run `python3 ...`: make it this environment's python
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            text = shown(line)
            if text is not None:
                print(f"  {text}", file=out, flush=True)
        proc.wait()
    elapsed = time.monotonic() - started
    summary = _find_summary(sorted(set(root.iterdir()) - before))
    ok = summary is not None and _succeeded(summary)
    print("\n" + "=" * 78, file=out)
    print(summary.read_text() if summary else "No summary was written.", file=out)
    print(f"kubellm: pipeline {'succeeded' if ok else 'FAILED'} in {elapsed:.0f}s", file=out)
    print(f"kubellm: full log: {log_path}", file=out, flush=True)
    return 0 if ok else 1


def _find_summary(run_dirs: list[Path]) -> Path | None:
    for run_dir in reversed(run_dirs):
        for report in run_dir.glob("summarize*/report"):
            return report
    return None


def _succeeded(summary: Path) -> bool:
    text = summary.read_text()
    return bool(text) and text.splitlines()[0].endswith(": SUCCEEDED")


def _execute(pipeline_yaml: str, root: str, arguments: dict[str, Any]) -> None:
    """The child: kfp.local runs the compiled YAML (its output goes to the log file)."""
    import warnings

    from kfp import local
    from kfp.components import load_component_from_file

    warnings.filterwarnings("ignore", message=".*non-Python base image.*")
    pipeline = load_component_from_file(pipeline_yaml)
    local.init(
        runner=local.SubprocessRunner(use_venv=False), pipeline_root=root, raise_on_error=False
    )
    pipeline(**arguments)


if __name__ == "__main__":
    _execute(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
