"""End to end with `platform=kubernetes`, on the simulated cluster (tests/fakes/sim_cluster.py).

The compiled YAML runs under kfp.local as in `make run`, behind a fake of the KFP v2
runtime (tests/fakes/kfp_runtime.py): the root driver and each step's launcher make their own
API requests (ConfigMap kfp-launcher, the artifact store's Secret, which KFP's profile
controller creates in the namespace manifests/base/namespace.yaml labels) as the run's
ServiceAccount, and the exit handler gets the backend's state (COMPLETE). Every stage goes
through the Kubernetes backends: preflight's fabric check and training are PyTorchJobs of two "pods"
(local processes the fake kubelet starts with the operator's PET_* environment, which
rendezvous like a 2-node job), tuning is a Katib Experiment whose trials' metrics are read
by Katib's StdOut collector from the trainer's real output, and the model is served by an
InferenceService. Every object passes the upstream schemas, the webhook rules and the
Role in manifests/base/rbac.yaml. The run's data figures and gate decision must match a
local run of the same seed.
"""

from __future__ import annotations

import re

import pytest

from fakes.kfp_runtime import ARTIFACT_SECRET, LAUNCHER_CONFIGMAP

from .conftest import HALF_LEARNABLE_STEPS, NAMESPACE, STAGES, Batch, LocalRun

# waiting on the batch (tests/e2e/conftest.py) is most of a test: the runs share the cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
# Rows of the summary that depend only on the data and the seed, and the gate's decision.
SAME_AS_LOCAL = ("records read / kept", "tokens (train / val)", "data fingerprint")


def summary_rows(text: str) -> dict[str, str]:
    return dict(re.findall(r"^\| ([^|]+?) \| (.*) \|$", text, flags=re.M))


@pytest.mark.pipeline_runs("cluster", "local")
def test_the_pipeline_runs_on_the_simulated_cluster(batch: Batch, local_run: LocalRun) -> None:
    # the committed YAML with platform=kubernetes: the batch's `cluster` run (SMALL, the
    # half-learnable data, HALF_LEARNABLE_STEPS, 2 nodes of 1 process, a real mlflow server)
    run = batch.result("cluster")
    summary, output, sim, seen = run.summary, run.output, run.sim, run.seen
    # the backend said COMPLETE: that is success, with nothing listed as failed
    assert summary.splitlines()[0].endswith(": SUCCEEDED"), summary + output[-6000:]
    assert "Failed stages:" not in summary, summary
    fake = sim.fake
    assert sim.errors == [] and fake.errors == [], (sim.errors, fake.errors)
    assert fake.forbidden == [], "a request the Role does not allow"

    # the KFP runtime's own requests, as the run's ServiceAccount: the root driver read
    # kfp-launcher once, and a launcher read the artifact Secret before every step
    gets = [r.path for r in fake.requests if r.method == "GET"]
    core = f"/api/v1/namespaces/{NAMESPACE}"
    assert gets.count(f"{core}/configmaps/{LAUNCHER_CONFIGMAP}") == 1
    launched = re.findall(r"^kfp-runtime: launcher ([\w-]+) ", output, flags=re.M)
    assert {s.replace("_", "-") for s in STAGES} | {"summarize"} <= set(launched), launched
    assert gets.count(f"{core}/secrets/{ARTIFACT_SECRET}") == len(launched)

    # preflight's fabric check and training: 2-node PyTorchJobs, both pods ran
    jobs = {j["metadata"]["name"]: j for j in fake.created("pytorchjobs")}
    train = next(n for n in jobs if "-train-" in n)
    assert any("-fabric-" in n for n in jobs)
    assert jobs[train]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    master = fake.pod_log(NAMESPACE, f"{train}-master-0")
    worker = seen.get(("pods", f"{train}-worker-0"))
    assert re.search(rf"train: {HALF_LEARNABLE_STEPS}/{HALF_LEARNABLE_STEPS} steps", master)
    assert "world_size=2" in master or "world 2" in master, master[-2000:]
    assert worker is not None and worker["status"]["phase"] == "Succeeded"  # rank 1 is quiet
    (container,) = worker["spec"]["containers"]
    injected = {e["name"]: e.get("value") for e in container["env"]}
    assert (injected["PET_NNODES"], injected["PET_NODE_RANK"]) == ("2", "1")
    # the step streamed the master's log while the job ran
    assert f"[{train}-master-0]" in output or "train: " in output

    # tuning: one Experiment; Katib's collector read each trial's eval_loss
    (experiment,) = fake.created("experiments")
    exp = seen.get(("experiments", experiment["metadata"]["name"]))
    assert exp is not None
    optimal = exp["status"]["currentOptimalTrial"]
    assert optimal["bestTrialName"].startswith(experiment["metadata"]["name"])
    rows = summary_rows(summary)
    assert rows["best trial"].startswith(optimal["bestTrialName"])

    # serving: the InferenceService answered the smoke test
    (isvc,) = fake.created("inferenceservices")
    assert isvc["metadata"]["name"] == "kubellm-tiny"
    # KServe's Hugging Face runtime on the registered version's copy, all traffic (a
    # first deployment has no previous revision to share it with)
    predictor = isvc["spec"]["predictor"]
    assert predictor["model"]["modelFormat"]["name"] == "huggingface"
    assert predictor["model"]["storageUri"].startswith("pvc://")
    assert isvc["metadata"]["annotations"]["kubellm/model-version"] == "1"
    live = fake.get_object("inferenceservices", "kubellm-tiny", NAMESPACE)
    assert live is not None
    traffic = live["status"]["components"]["predictor"]["traffic"]
    assert [(t["revisionName"], t["percent"]) for t in traffic] == [
        ("kubellm-tiny-predictor-00001", 100)
    ]
    assert rows["endpoint"].startswith("http://127.0.0.1:")
    assert rows["gate"].startswith("promote")

    # the same parameters run locally (the session's local_run, which the local e2e test
    # checks in full): the data figures and the gate decision must be equal
    local = local_run.proc
    assert local.returncode == 0, local.stdout[-4000:] + local.stderr[-4000:]
    local_rows = summary_rows(local.stdout[local.stdout.rindex("=" * 78) :])
    for row in SAME_AS_LOCAL:
        assert rows[row] == local_rows[row], row
    assert rows["gate"].split()[0] == local_rows["gate"].split()[0] == "promote"
