"""A run stopped mid-training on the simulated cluster leaves nothing running (issue 19).

KFP's terminate sets the Workflow's activeDeadlineSeconds to 0; Argo signals each running
step, whose emissary forwards SIGTERM to the step's process group and exits as soon as the
KFP launcher (no handler) has, and the kernel kills the rest: our step's own SIGTERM cleanup
is a best effort (tests/fakes/emissary.py plays the worst case). The exit handler still runs
(Argo exempts it from the deadline), and it deletes the run's PyTorchJobs and Experiment.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.kfp_runtime import install_profile_objects, namespace_labels
from fakes.sim_cluster import SimCluster
from kubellm.backends.kubernetes.podspec import RUN_LABEL
from tracking.mlflow_server import running_mlflow_server

from .conftest import SMALL
from .test_cluster_pipeline import CLUSTER, NAMESPACE, run_pipeline

pytestmark = pytest.mark.slow


def test_a_run_stopped_mid_training_leaves_no_job_or_experiment(
    tmp_path: Path, half_learnable: Path
) -> None:
    # long enough to be stopped while it trains; one trial, so the run has an Experiment
    params = {**SMALL, "data_source": str(half_learnable), "train_steps": 100_000}
    params.update(tune_trials=1, tune_max_failed=0)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with (
        SimCluster(tmp_path / "cluster") as sim,
        running_mlflow_server(tmp_path, tmp_path / "mlflow.db") as mlflow,
    ):
        install_profile_objects(sim.fake, NAMESPACE, namespace_labels())
        env = {**env, **sim.env(NAMESPACE), "PYTHONUNBUFFERED": "1"}
        summary, output = run_pipeline(
            tmp_path / "kfp",
            env,
            {**params, **CLUSTER, "mlflow_tracking_uri": mlflow.url, "runs_dir": str(tmp_path)},
            runner="e2e.stop_runner:run",
        )
        fake = sim.fake
        assert "stop-runner: stopping the train step" in output, output[-6000:]
        assert summary.splitlines()[0].endswith(": FAILED"), summary
        assert "- train (KILLED): still RUNNING" in summary, summary  # the stopped stage
        assert sim.errors == [] and fake.errors == [] and fake.forbidden == []

        jobs = [j["metadata"]["name"] for j in fake.created("pytorchjobs")]
        train = next(n for n in jobs if "-train-" in n)
        (experiment,) = (e["metadata"]["name"] for e in fake.created("experiments"))
        # the stopped step did not get to delete its job: the exit handler did
        assert f"summary: pytorchjob/{train} in {NAMESPACE}: deleted" in output, output[-6000:]
        assert f"summary: experiment/{experiment} in {NAMESPACE}: deleted" in output

        def labelled(plural: str) -> list[Any]:
            return [
                o["metadata"]["name"]
                for o in fake.list_objects(plural, NAMESPACE)
                if RUN_LABEL in (o["metadata"].get("labels") or {})
            ]

        assert labelled("pytorchjobs") == [] and labelled("experiments") == []
        assert fake.list_objects("pytorchjobs", NAMESPACE) == []
        assert fake.list_objects("experiments", NAMESPACE) == []
