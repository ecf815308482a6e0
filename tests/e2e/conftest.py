"""Shared by the end-to-end tests: the small pipeline settings, the half-learnable data, and
the batch of pipeline runs the tests check (started together, see `Batch`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from background_runs import BackgroundRuns

from fakes.kfp_runtime import install_profile_objects, namespace_labels
from fakes.sim_cluster import SimCluster
from kubellm.commands.local_stages import STAGES as SPAN_STAGES
from kubellm.config import pipeline_config
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
# The stages with an MLflow run of their own: every step of a full run but the exit handler
# and record_data (which logs into prepare_data's run)
STAGES = {"preflight", *SPAN_STAGES} - {"record_data"}


# Half of these questions have a learnable answer (`abc?` -> `yes`), half a random one
# (`abc!` -> three random letters): the model's held-out exact match tops out near 0.5 by
# construction. With SMALL's model, 120 training steps reach 0.4-0.5 (measured 0.47 at 100
# steps by hand), so the default gate (0.2) promotes and 0.9 rejects: the gate is exercised
# where a real decision lies, not only at 0 and 1.
HALF_LEARNABLE_STEPS = 120
REJECT_ABOVE = 0.9
# The chat fine-tune's run: records in Llama 3's chat format, LoRA on the tiny base model, no
# tuning, a few steps (what is checked is the format, not what the model learns), whole
# documents per row (best_fit) so each record's training text can be read back, and no
# accuracy bar (a few LoRA steps on random weights answer nothing right).
CHAT_RECORDS = 240
CHAT_RUN: dict[str, Any] = {
    "template": "messages",
    "lora_r": 8,
    "tune_trials": 0,
    "train_steps": 8,
    "nproc_per_node": 1,  # one trainer process starts sooner than two
    "seq_len": 128,
    "packing": "best_fit",
    "gate_min_accuracy": 0.0,
}


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


def run_to_files(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(..., capture_output=True)` with the output in files under `cwd`
    (stdout.txt, stderr.txt): a run's progress can be read while the batch runs, and its
    output is still there afterwards."""
    out, err = cwd / "stdout.txt", cwd / "stderr.txt"
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=fo, stderr=fe, text=True, env=env)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())


def _run(tmp: Path, pipeline: Path, **overrides: Any) -> subprocess.CompletedProcess[str]:
    """`kubellm run --local` of SMALL with `overrides`, in `tmp`."""
    sets = [a for k, v in {**SMALL, **overrides}.items() for a in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "kubellm.cli", "run", "--local", "--pipeline", str(pipeline)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return run_to_files([*cmd, *sets], tmp, env, timeout_s=1200)


NAMESPACE = "kubellm"
TRAINER_V2_RUNTIME = REPO / "manifests" / "cluster" / "trainer-v2" / "clustertrainingruntime.yaml"
# Two nodes of one process each: the same world size (and so the same batches) as the local
# run's one node of two processes.
CLUSTER = {"platform": "kubernetes", "num_nodes": 2, "nproc_per_node": 1, "namespace": NAMESPACE}


def run_pipeline(
    root: Path, env: dict[str, str], overrides: dict[str, Any], runner: str = ""
) -> tuple[str, str]:
    """kfp.local runs the committed YAML (as `kubellm run --local` does, without forcing
    platform=local) behind the KFP runtime's fake (`python -m fakes.kfp_runtime`, which
    wraps kubellm.commands.local_run's child; `runner`, MODULE:FUNCTION, runs each task's process);
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
    root.mkdir(parents=True, exist_ok=True)
    proc = run_to_files(cmd, root, {**env, "PYTHONPATH": path}, timeout_s=1800)
    output = proc.stdout + proc.stderr
    reports = sorted(root.glob("*/summarize*/report"))
    assert reports, output[-6000:]
    return reports[-1].read_text(), output


@dataclass(frozen=True)
class LocalRun:
    """One `kubellm run --local` of SMALL (and the run's overrides) in `tmp`; `server` is
    the real `mlflow server` it recorded to, if it had one (else sqlite under tmp/runs)."""

    tmp: Path
    proc: subprocess.CompletedProcess[str]
    server: MlflowServer | None = None


@dataclass(frozen=True)
class ClusterRun:
    """One run of the committed YAML with `platform=kubernetes` on a SimCluster that stays
    up for the session (its fake API server holds what the run did)."""

    tmp: Path
    sim: SimCluster
    summary: str
    output: str
    seen: dict[tuple[str, str], dict[str, Any]]  # each object as last stored (plural, name)


class Batch(BackgroundRuns):
    """The suite's pipeline runs, started together: each is a few subprocesses in a row,
    most of them one core's work at a time, so PARALLEL of them share the two cores better
    than one after the other (the e2e tests went from ~9 to ~7 minutes). A test asks for a
    run's result and waits for it; the servers and simulated clusters the runs used stay up
    until the session ends."""

    ORDER = ("cluster", "trainjob", "local", "stop", "reject", "chat", "failing")  # longest first

    def __init__(self, half_learnable: Path, tmp: pytest.TempPathFactory, parallel: int):
        super().__init__(parallel, "e2e-run")
        self._data, self._tmp = half_learnable, tmp
        self._stack = ExitStack()
        self._stack_lock = threading.Lock()

    def run(self, name: str) -> Any:
        return getattr(self, f"_{name}")()

    def close(self) -> None:
        super().close()
        self._stack.close()

    def _enter(self, cm: Any) -> Any:
        with self._stack_lock:
            return self._stack.enter_context(cm)

    # --- the runs (ORDER lists them; a test marks which it needs: `pipeline_runs(...)`) ---

    def _local(self) -> LocalRun:
        """SMALL on the half-learnable data with the default gate, against a real `mlflow
        server`: checked in full by the local e2e test, compared with by the cluster one."""
        tmp = self._tmp.mktemp("local-run")
        (tmp / "mlflow").mkdir()
        server = self._enter(running_mlflow_server(tmp / "mlflow", tmp / "mlflow.db"))
        proc = _run(
            tmp,
            _copy_yaml(tmp, "e2e-copy"),
            data_source=self._data,
            train_steps=HALF_LEARNABLE_STEPS,
            mlflow_tracking_uri=server.url,
        )  # the default gate, 0.2
        return LocalRun(tmp, proc, server)

    def _reject(self) -> LocalRun:
        tmp = self._tmp.mktemp("reject-run")
        proc = _run(
            tmp,
            REPO / "pipelines" / "llm_train.yaml",
            data_source=self._data,
            tune_trials=0,
            train_steps=HALF_LEARNABLE_STEPS,
            gate_min_accuracy=REJECT_ABOVE,  # above what this model reaches (near 0.5 at most)
        )
        return LocalRun(tmp, proc)

    def _chat(self) -> LocalRun:
        """A LoRA fine-tune of a tiny Llama-3-style chat model (tests/fixtures/llama_chat.py)
        on chat records, as small as the whole pipeline allows: checked by
        test_chat_finetune.py (training text and served answers in the model's own format)."""
        from fixtures.llama_chat import build_model, chat_records

        tmp = self._tmp.mktemp("chat-run")
        base = build_model(tmp / "base-model")
        data = tmp / "chats.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(CHAT_RECORDS)))
        proc = _run(
            tmp,
            REPO / "pipelines" / "llm_train.yaml",
            **CHAT_RUN,
            data_source=data,
            base_model=base,
        )
        return LocalRun(tmp, proc)

    def _failing(self) -> LocalRun:
        tmp = self._tmp.mktemp("failing-run")
        proc = _run(
            tmp, REPO / "pipelines" / "llm_train.yaml", data_source=str(tmp / "missing-*.jsonl")
        )
        return LocalRun(tmp, proc)

    def _cluster(self) -> ClusterRun:
        params = {**SMALL, "data_source": str(self._data), "train_steps": HALF_LEARNABLE_STEPS}
        return self._on_a_cluster("cluster-run", params)

    def _trainjob(self) -> ClusterRun:
        """The `cluster` run's parameters with training as a Trainer v2 TrainJob on the
        ClusterTrainingRuntime manifests/cluster/trainer-v2 ships (the cluster admin applies
        it): its exported model must equal the PyTorchJob run's."""
        params = {**SMALL, "data_source": str(self._data), "train_steps": HALF_LEARNABLE_STEPS}
        return self._on_a_cluster(
            "trainjob-run", {**params, "trainer_backend": "trainjob"}, runtimes=True
        )

    def _stop(self) -> ClusterRun:
        # long enough to be stopped while it trains; one trial, so the run has an Experiment
        params = {**SMALL, "data_source": str(self._data), "train_steps": 100_000}
        params.update(tune_trials=1, tune_max_failed=0)
        return self._on_a_cluster("stop-run", params, runner="e2e.stop_runner:run")

    def _on_a_cluster(
        self, name: str, params: dict[str, Any], runner: str = "", runtimes: bool = False
    ) -> ClusterRun:
        tmp = self._tmp.mktemp(name)
        bin_dir = str(Path(sys.executable).parent)  # `python3` and `kubellm` of this venv
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        env.pop("MLFLOW_TRACKING_URI", None)
        sim = self._enter(SimCluster(tmp / "cluster"))
        mlflow = self._enter(running_mlflow_server(tmp, tmp / "mlflow.db"))
        # KFP's profile controller syncs the namespace as manifests/base labels it
        install_profile_objects(sim.fake, NAMESPACE, namespace_labels())
        if runtimes:  # `kubectl apply -k manifests/cluster/trainer-v2`, as the cluster admin
            for doc in yaml.safe_load_all(TRAINER_V2_RUNTIME.read_text()):
                sim.fake.create_object("clustertrainingruntimes", doc)
        # the exit handler deletes the run's jobs and experiments: keep what they were
        seen: dict[tuple[str, str], dict[str, Any]] = {}
        sim.fake.add_listener(lambda e: seen.__setitem__((e.plural, e.name), e.obj))
        env = {**env, **sim.env(NAMESPACE), "PYTHONUNBUFFERED": "1"}
        overrides = {**params, **CLUSTER, "mlflow_tracking_uri": mlflow.url}
        summary, output = run_pipeline(
            tmp / "kfp", env, {**overrides, "runs_dir": str(tmp)}, runner=runner
        )
        return ClusterRun(tmp, sim, summary, output, seen)


@pytest.fixture(scope="session")
def batch(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    half_learnable: Path,
) -> Iterator[Batch]:
    """Starts every run a collected test marks `pipeline_runs(...)`, at once."""
    parallel = int(os.environ.get("KUBELLM_E2E_PARALLEL", "3"))
    runs = Batch(half_learnable, tmp_path_factory, parallel)
    yield from runs.started(request.session, "pipeline_runs")


@pytest.fixture(scope="session")
def local_run(batch: Batch) -> LocalRun:
    """Shared by the local e2e test (which checks it in full) and the cluster e2e test (whose
    data figures and gate decision must equal it): the suite runs it once."""
    return batch.result("local")
