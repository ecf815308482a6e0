"""A run stopped mid-training on the simulated cluster leaves nothing running (issue 19).

KFP's terminate sets the Workflow's activeDeadlineSeconds to 0; Argo signals each running
step, whose emissary forwards SIGTERM to the step's process group and exits as soon as the
KFP launcher (no handler) has, and the kernel kills the rest: our step's own SIGTERM cleanup
is a best effort (tests/fakes/emissary.py plays the worst case). The exit handler still runs
(Argo exempts it from the deadline), and it deletes the run's PyTorchJobs and Experiment.
"""

from __future__ import annotations

from typing import Any

import pytest

from kubellm.backends.kubernetes.podspec import RUN_LABEL

from .conftest import NAMESPACE, Batch

# waiting on the batch (tests/e2e/conftest.py) is most of a test: the runs share the cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.mark.pipeline_runs("stop")
def test_a_run_stopped_mid_training_leaves_no_job_or_experiment(batch: Batch) -> None:
    # the batch's `stop` run: 100,000 training steps and one trial (so the run has an
    # Experiment); e2e/stop_runner.py stops the train step once its master pod runs
    run = batch.result("stop")
    summary, output, sim = run.summary, run.output, run.sim
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
