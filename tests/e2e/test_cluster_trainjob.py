"""End to end with `platform=kubernetes, trainer_backend=trainjob`, on the simulated cluster.

The batch's `trainjob` run is the `cluster` run (test_cluster_pipeline.py) with training and
preflight's fabric check as Kubeflow Trainer v2 TrainJobs: the simulated Trainer v2.3.0
controller (tests/fakes/trainer_v2.py) builds each one's JobSet from the ClusterTrainingRuntime
manifests/cluster/trainer-v2 ships, the JobSet controller (jobset.py) its Indexed Job, the Job
controller two "pods" (local processes with the torch plugin's PET_* environment), which
rendezvous like a 2-node job. Katib trials stay PyTorchJobs (README, "Trainer v2"). The model
the TrainJob exports must be, tensor for tensor, the one the PyTorchJob run exports for the
same seed: the backend changes where the processes run, not what they compute.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from .conftest import HALF_LEARNABLE_STEPS, NAMESPACE, Batch, ClusterRun
from .test_cluster_pipeline import summary_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def exported_model(run: ClusterRun) -> dict[str, torch.Tensor]:
    """The train step's output artifact (what register copies and deploy serves)."""
    (path,) = sorted((run.tmp / "kfp").glob("*/train*/model/model.safetensors"))
    return load_file(path)


def pods_of(run: ClusterRun, jobset: str) -> list[dict]:
    pods = [o for (plural, _), o in run.seen.items() if plural == "pods"]
    return [p for p in pods if p["metadata"].get("labels", {}).get(JOBSET_NAME_LABEL) == jobset]


@pytest.mark.pipeline_runs("trainjob", "cluster")
def test_the_pipeline_trains_with_a_trainjob_and_exports_the_pytorchjob_model(
    batch: Batch,
) -> None:
    run = batch.result("trainjob")
    summary, output, sim = run.summary, run.output, run.sim
    assert summary.splitlines()[0].endswith(": SUCCEEDED"), summary + output[-6000:]
    assert "Failed stages:" not in summary, summary
    fake = sim.fake
    assert sim.errors == [] and fake.errors == [], (sim.errors, fake.errors)
    assert fake.forbidden == [], "a request the Role does not allow"

    # training and the fabric check were TrainJobs on kubellm-torch; no PyTorchJob of ours
    trainjobs = {j["metadata"]["name"]: j for j in fake.created("trainjobs")}
    train = next(n for n in trainjobs if "-train-" in n)
    assert any("-fabric-" in n for n in trainjobs), sorted(trainjobs)
    assert {j["spec"]["runtimeRef"]["name"] for j in trainjobs.values()} == {"kubellm-torch"}
    assert trainjobs[train]["spec"]["trainer"]["numNodes"] == 2
    ours = [j["metadata"]["name"] for j in fake.created("pytorchjobs")]
    assert not [n for n in ours if "-train-" in n or "-fabric-" in n], ours
    final = run.seen[("trainjobs", train)]
    assert any(
        c["type"] == "Complete" and c["status"] == "True" for c in final["status"]["conditions"]
    ), final["status"]

    # two pods, one per node (Job completion index), with the torch plugin's env: they
    # rendezvoused (world 2)
    pods = pods_of(run, train)
    index = {p["metadata"]["annotations"][COMPLETION_INDEX]: p for p in pods}
    assert len(pods) == 2 and sorted(index) == ["0", "1"], [p["metadata"]["name"] for p in pods]
    for pod in pods:
        assert pod["status"]["phase"] == "Succeeded", pod["status"]
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["PET_NNODES"]["value"] == "2"
        assert env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            f"metadata.annotations['{COMPLETION_INDEX}']"
        )
    node0 = index["0"]
    log = fake.pod_log(NAMESPACE, node0["metadata"]["name"])
    assert re.search(rf"train: {HALF_LEARNABLE_STEPS}/{HALF_LEARNABLE_STEPS} steps", log), log[
        -2000:
    ]
    assert "world_size=2" in log or "world 2" in log, log[-2000:]

    # the exit handler deleted the run's TrainJobs (their JobSets, Jobs and pods with them)
    for name in trainjobs:
        assert f"summary: trainjob/{name} in {NAMESPACE}: deleted" in output, output[-6000:]
    assert fake.list_objects("trainjobs", NAMESPACE) == []
    assert fake.list_objects("jobsets", NAMESPACE) == []

    # the rest of the pipeline as on the PyTorchJob backend: tuned, gated, served
    rows = summary_rows(summary)
    assert rows["gate"].startswith("promote"), rows
    assert rows["endpoint"].startswith("http://127.0.0.1:"), rows

    # the same seed on the PyTorchJob backend (the batch's `cluster` run): the same
    # tuning result, the same data, and the exported weights equal tensor for tensor
    pytorchjob = batch.result("cluster")
    assert pytorchjob.summary.splitlines()[0].endswith(": SUCCEEDED"), pytorchjob.summary
    other = summary_rows(pytorchjob.summary)
    for row in ("records read / kept", "tokens (train / val)", "data fingerprint"):
        assert rows[row] == other[row], row
    mine, theirs = exported_model(run), exported_model(pytorchjob)
    assert mine.keys() == theirs.keys() and mine
    unequal = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert unequal == [], unequal
