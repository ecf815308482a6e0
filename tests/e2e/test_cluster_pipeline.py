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

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fakes.kfp_runtime import (
    ARTIFACT_SECRET,
    LAUNCHER_CONFIGMAP,
    install_profile_objects,
    namespace_labels,
)
from fakes.sim_cluster import SimCluster
from kubellm.config import pipeline_config
from tracking.mlflow_server import running_mlflow_server

from .conftest import HALF_LEARNABLE_STEPS, REPO, SMALL, STAGES, LocalRun

pytestmark = pytest.mark.slow
NAMESPACE = "kubellm"
# Two nodes of one process each: the same world size (and so the same batches) as the local
# run's one node of two processes.
CLUSTER = {"platform": "kubernetes", "num_nodes": 2, "nproc_per_node": 1, "namespace": NAMESPACE}
# Rows of the summary that depend only on the data and the seed, and the gate's decision.
SAME_AS_LOCAL = ("records read / kept", "tokens (train / val)", "data fingerprint")


def summary_rows(text: str) -> dict[str, str]:
    return dict(re.findall(r"^\| ([^|]+?) \| (.*) \|$", text, flags=re.M))


def run_pipeline(
    root: Path, env: dict[str, str], overrides: dict[str, Any], runner: str = ""
) -> tuple[str, str]:
    """kfp.local runs the committed YAML (as `kubellm run --local` does, without forcing
    platform=local) behind the KFP runtime's fake (`python -m fakes.kfp_runtime`, which
    wraps kubellm.local_run's child; `runner`, MODULE:FUNCTION, runs each task's process);
    returns (the summary report, the output)."""
    cfg = pipeline_config(overrides)
    arguments = {k: getattr(cfg, k) for k in overrides}  # typed as the pipeline declares
    cmd = [
        sys.executable,
        "-m",
        "fakes.kfp_runtime",
        str(REPO / "pipelines" / "llm_train.yaml"),
        str(root),
        json.dumps(arguments),
        *(["--run-subprocess", runner] if runner else []),
    ]
    # fakes/ is under tests/; appended, so nothing there shadows what the steps import
    path = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO / "tests")) if p)
    env = {**env, "PYTHONPATH": path}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    output = proc.stdout + proc.stderr
    reports = sorted(root.glob("*/summarize*/report"))
    assert reports, output[-6000:]
    return reports[-1].read_text(), output


def test_the_pipeline_runs_on_the_simulated_cluster(
    tmp_path: Path, half_learnable: Path, local_run: LocalRun
) -> None:
    params = {**SMALL, "data_source": str(half_learnable), "train_steps": HALF_LEARNABLE_STEPS}
    bin_dir = str(Path(sys.executable).parent)  # `python3` and `kubellm` of this environment
    base_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    base_env.pop("MLFLOW_TRACKING_URI", None)

    with (
        SimCluster(tmp_path / "cluster") as sim,
        running_mlflow_server(tmp_path, tmp_path / "mlflow.db") as mlflow,
    ):
        # KFP's profile controller syncs the namespace as manifests/base labels it
        install_profile_objects(sim.fake, NAMESPACE, namespace_labels())
        # each object as last stored: the exit handler deletes the run's jobs and experiments
        seen: dict[tuple[str, str], dict[str, Any]] = {}
        sim.fake.add_listener(lambda e: seen.__setitem__((e.plural, e.name), e.obj))
        env = {**base_env, **sim.env(NAMESPACE), "PYTHONUNBUFFERED": "1"}
        summary, output = run_pipeline(
            tmp_path / "kfp",
            env,
            {**params, **CLUSTER, "mlflow_tracking_uri": mlflow.url, "runs_dir": str(tmp_path)},
        )
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
