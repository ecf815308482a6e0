"""Shared by the end-to-end tests: the small pipeline settings and the half-learnable data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tracking.mlflow_server import MlflowServer, running_mlflow_server

REPO = Path(__file__).resolve().parents[2]
SMALL = {
    "num_records": 3000,
    "vocab_size": 300,
    "seq_len": 16,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "tune_trials": 2,
    "tune_steps": 8,
    "train_steps": 40,
    "batch_size": 8,
}
STAGES = {
    "preflight",
    "prepare_data",
    "tune",
    "train",
    "evaluate",
    "register",
    "deploy",
    "smoke_test",
}


# Half of these questions have a learnable answer (`abc?` -> `yes`), half a random one
# (`abc!` -> three random letters): the model's held-out exact match tops out near 0.5 by
# construction. With SMALL's model, 120 training steps reach 0.4-0.5 (measured 0.47 at 100
# steps by hand), so the default gate (0.2) promotes and 0.9 rejects: the gate is exercised
# where a real decision lies, not only at 0 and 1.
HALF_LEARNABLE_STEPS = 120
REJECT_ABOVE = 0.9


@pytest.fixture(scope="session")
def half_learnable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    path = tmp_path_factory.mktemp("data") / "half.jsonl"
    with path.open("w") as fh:
        for i in range(3000):
            word = "".join(rng.choice(letters) for _ in range(3))
            if i % 2 == 0:
                prompt, completion = f"{word}?", "yes"
            else:
                prompt, completion = f"{word}!", "".join(rng.choice(letters) for _ in range(3))
            fh.write(
                json.dumps(
                    {"text": prompt + completion, "prompt": prompt, "completion": completion}
                )
                + "\n"
            )
    return path


def _copy_yaml(tmp: Path, name: str) -> Path:
    """The committed YAML under another pipeline name: the run's folder proves what ran."""
    docs = list(yaml.safe_load_all((REPO / "pipelines" / "llm_train.yaml").read_text()))
    docs[0]["pipelineInfo"]["name"] = name
    out = tmp / f"{name}.yaml"
    out.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return out


def _run(tmp: Path, pipeline: Path, **overrides: Any) -> subprocess.CompletedProcess[str]:
    sets = [a for k, v in {**SMALL, **overrides}.items() for a in ("--set", f"{k}={v}")]
    return subprocess.run(
        [sys.executable, "-m", "kubellm.cli", "run", "--local", "--pipeline", str(pipeline), *sets],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@dataclass(frozen=True)
class LocalRun:
    """One `kubellm run --local` of SMALL on the half-learnable data with the default gate,
    against a real `mlflow server` that stays up for the session."""

    tmp: Path
    proc: subprocess.CompletedProcess[str]
    server: MlflowServer


@pytest.fixture(scope="session")
def local_run(tmp_path_factory: pytest.TempPathFactory, half_learnable: Path) -> Iterator[LocalRun]:
    """Shared by the local e2e test (which checks it in full) and the cluster e2e test (whose
    data figures and gate decision must equal it): the suite runs it once."""
    tmp = tmp_path_factory.mktemp("local-run")
    (tmp / "mlflow").mkdir()
    with running_mlflow_server(tmp / "mlflow", tmp / "mlflow.db") as server:
        proc = _run(
            tmp,
            _copy_yaml(tmp, "e2e-copy"),
            data_source=half_learnable,
            train_steps=HALF_LEARNABLE_STEPS,
            mlflow_tracking_uri=server.url,
        )  # the default gate, 0.2
        yield LocalRun(tmp, proc, server)
