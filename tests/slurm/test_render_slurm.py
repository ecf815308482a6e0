"""`kubellm render --target slurm`: the sbatch scripts a platform=slurm run submits."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kubellm.cli import main


def test_cli_prints_each_stages_script(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    args = ["render", "--target", "slurm", "--set", "gpus_per_node=8", "--set", "num_nodes=2"]
    args += ["--set", "slurm_partition=gpu", "--set", "slurm_account=team-a"]
    args += ["--set", "runs_dir=/shared/runs", "--set", "tune_trials=2", "--set", "fabric=rdma-ib"]
    assert main(args) == 0
    out = capsys.readouterr().out
    headers = [ln for ln in out.splitlines() if ln.startswith("# ---- ")]
    assert [h.split(":")[0] for h in headers] == ["# ---- preflight", "# ---- tune", "# ---- train"]
    scripts = out.split("# ---- ")[1:]
    for script in scripts:
        for text in ("--nodes=2", "--gres=gpu:8", "--partition=gpu", "--account=team-a"):
            assert f"#SBATCH {text}" in script, script
        assert "export NCCL_IB_HCA=mlx5" in script
        body = script.split("\n", 1)[1]
        path = tmp_path / "s.sh"
        path.write_text(body)
        subprocess.run(["bash", "-n", str(path)], check=True)
    assert "-m kubellm.train.fabric" in scripts[0]
    # the search: one array job of two trials, each task its own learning rate
    assert "#SBATCH --array=0-1%1" in scripts[1]
    rates = re.findall(r"--set learning_rate=(\S+) ", scripts[1])
    assert len(rates) == 2 and rates[0] != rates[1], scripts[1]
    assert "--config /shared/runs/work/0123456789ab/config/train.json" in scripts[2]
    assert "--output=/shared/runs/slurm/0123456789ab/" in scripts[2]


def test_the_readmes_training_script_is_what_render_prints() -> None:
    """README "Running on a Slurm cluster" shows the train script of its own command line."""
    from pathlib import Path

    from kubellm.commands.render_slurm import render_slurm

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Running on a Slurm cluster") :]
    shown = section[section.index("```bash\n#!/bin/bash\n") + len("```bash\n") :]
    shown = shown[: shown.index("```\n")]
    python = re.search(r"exec (\S+) -m kubellm.train.agent", shown)[1]
    overrides = {"gpus_per_node": 8, "num_nodes": 2, "slurm_partition": "gpu"}
    out = render_slurm({**overrides, "runs_dir": "/shared/kubellm-runs"})
    train = out[out.index("# ---- train: ") :].split("\n", 1)[1]
    assert shown == train.replace(f"exec {sys.executable} ", f"exec {python} ")
