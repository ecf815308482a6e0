"""KatibTuner against the fake API server (schemas: Katib's OpenAPI spec + the PyTorchJob CRD),
and on the simulated cluster, whose Katib wraps each trial's command as its pod webhook does."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakes.fake_k8s import FakeK8s
from fakes.sim_cluster import WORKSPACE_PVC, SimCluster
from kubellm.backends.base import JobFailed, JobTimeout, TrainJob, TuneRequest
from kubellm.backends.kubernetes.katib import (
    TRIAL_SHELL,
    KatibTuner,
    build_experiment,
    trial_log_dir,
)
from kubellm.config import TrainConfig
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.train.checkpoint import complete_checkpoints
from kubellm.tune.search import SearchParam

from .conftest import POLL_S

SPACE = [
    SearchParam("learning_rate", 1e-4, 1e-2, log=True),
    SearchParam("batch_size", 8, 64, kind="int"),
]
BASE_ARGS = ["--config", "/workspace/run/train.json"]
CREATED = {"type": "Created", "status": "True", "reason": "ExperimentCreated"}
RUNNING = {
    "conditions": [CREATED, {"type": "Running", "status": "True", "reason": "ExperimentRunning"}],
    "trials": 2,
    "trialsRunning": 2,
}
BEST = {
    "bestTrialName": "llm-tune-abcd1234",
    "parameterAssignments": [
        {"name": "learning_rate", "value": "0.0031"},
        {"name": "batch_size", "value": "32"},
    ],
    "observation": {"metrics": [{"name": "eval_loss", "latest": "1.25", "min": "1.2", "max": "3"}]},
}
SUCCEEDED = {
    "conditions": [
        CREATED,
        {"type": "Running", "status": "False", "reason": "ExperimentRunning"},
        {
            "type": "Succeeded",
            "status": "True",
            "reason": "ExperimentMaxTrialsReached",
            "message": "Experiment has succeeded because max trial count has reached",
        },
    ],
    "currentOptimalTrial": BEST,
    "trials": 2,
    "trialsSucceeded": 1,
    "trialsFailed": 1,
    "succeededTrialList": ["llm-tune-abcd1234"],
    "failedTrialList": ["llm-tune-efgh5678"],
}
FAILED = {
    "conditions": [
        CREATED,
        {"type": "Running", "status": "False"},
        {
            "type": "Failed",
            "status": "True",
            "reason": "ExperimentFailed",  # Katib's ExperimentFailedReason
            "message": "Experiment has failed because max failed count has reached",
        },
    ],
    "trials": 2,
    "trialsFailed": 2,
}


def request(**overrides: Any) -> TuneRequest:
    base: dict[str, Any] = {
        "name": "llm-tune",
        "trial_job": TrainJob(
            name="trial", image="ghcr.io/example/kubellm-trainer:test", train_args=BASE_ARGS
        ),
        "space": SPACE,
        "max_trials": 2,
        "parallel_trials": 2,
        "seed": 7,
        "timeout_s": 10.0,
    }
    return TuneRequest(**{**base, **overrides})


def trial(name: str, lr: str, bs: str, cond: str, loss: str | None) -> dict[str, Any]:
    metrics = [{"name": "eval_loss", "latest": loss, "min": loss, "max": loss}] if loss else []
    return {
        "apiVersion": "kubeflow.org/v1beta1",
        "kind": "Trial",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"katib.kubeflow.org/experiment": "llm-tune"},
        },
        "spec": {
            "parameterAssignments": [
                {"name": "learning_rate", "value": lr},
                {"name": "batch_size", "value": bs},
            ]
        },
        "status": {
            "conditions": [{"type": cond, "status": "True"}],
            "observation": {"metrics": metrics},
        },
    }


def add_trials(fake: FakeK8s, _experiment: dict[str, Any]) -> None:
    """What Katib's controller does after the Experiment is created (plus a stranger's trial)."""
    fake.put_object("trials", trial("llm-tune-abcd1234", "0.0031", "32", "Succeeded", "1.25"))
    fake.put_object("trials", trial("llm-tune-efgh5678", "0.009", "8", "Failed", None))
    other = trial("other-xyz", "0.1", "8", "Succeeded", "0.5")
    other["metadata"]["labels"]["katib.kubeflow.org/experiment"] = "other"
    fake.put_object("trials", other)


def trial_container(experiment: dict[str, Any]) -> dict[str, Any]:
    spec = experiment["spec"]["trialTemplate"]["trialSpec"]["spec"]
    (container,) = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    return dict(container)


@dataclass
class SpaceCase:
    name: str
    param: SearchParam
    parameter: dict[str, Any]


SPACE_CASES = [
    SpaceCase(
        "double-log",
        SearchParam("learning_rate", 1e-4, 1e-2, log=True),
        {
            "name": "learning_rate",
            "parameterType": "double",
            "feasibleSpace": {"min": "0.0001", "max": "0.01", "distribution": "logUniform"},
        },
    ),
    SpaceCase(
        "int-uniform",
        SearchParam("batch_size", 8, 64, kind="int"),
        {
            "name": "batch_size",
            "parameterType": "int",
            "feasibleSpace": {"min": "8", "max": "64", "distribution": "uniform"},
        },
    ),
]


@pytest.mark.parametrize("case", SPACE_CASES, ids=lambda c: c.name)
def test_parameters_from_search_space(case: SpaceCase, fake_k8s: FakeK8s) -> None:
    body = build_experiment(request(space=[case.param]))
    assert body["spec"]["parameters"] == [case.parameter]
    assert fake_k8s.validate("experiments", body) == []


def test_experiment_embeds_the_trainers_pytorchjob(fake_k8s: FakeK8s) -> None:
    body = build_experiment(request())
    spec = body["spec"]
    assert fake_k8s.validate("experiments", body) == []
    assert spec["objective"] == {
        "type": "minimize",
        "objectiveMetricName": "eval_loss",
        "metricStrategies": [{"name": "eval_loss", "value": "latest"}],
    }
    assert spec["algorithm"] == {
        "algorithmName": "tpe",
        "algorithmSettings": [{"name": "random_state", "value": "7"}],
    }
    assert (spec["maxTrialCount"], spec["parallelTrialCount"], spec["maxFailedTrialCount"]) == (
        2,
        2,
        1,
    )
    assert spec["metricsCollectorSpec"] == {"collector": {"kind": "StdOut"}}
    template = spec["trialTemplate"]
    assert template["primaryContainerName"] == "pytorch"
    assert (
        template["successCondition"] == 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
    )
    assert template["failureCondition"] == 'status.conditions.#(type=="Failed")#|#(status=="True")#'
    assert template["trialSpec"]["kind"] == "PyTorchJob"
    # Katib names the trial's job; only labels are ours (name and namespace must be omitted)
    assert template["trialSpec"]["metadata"] == {
        "labels": {"app.kubernetes.io/managed-by": "kubellm"}
    }
    container = trial_container(body)
    # the trainer's command, under the trial shell that passes SIGTERM on (see katib.py)
    assert container["command"] == ["sh", "-c"]
    (script,) = container["args"]
    assert script.startswith(TRIAL_SHELL + " ")
    assert shlex.split(script[len(TRIAL_SHELL) :]) == [
        "python",
        "-m",
        "kubellm.train.agent",
        "-m",
        "kubellm.train",
        *BASE_ARGS,
        "--set",
        "learning_rate=${trialParameters.learning_rate}",
        "--set",
        "batch_size=${trialParameters.batch_size}",
    ]
    assert "$$" not in script and "$(" not in script  # the kubelet would expand those
    names = {e["name"] for e in container["env"]}
    assert "KUBELLM_LOG_DIR" not in names  # no workspace PVC: nowhere to save the output


def test_with_a_workspace_each_trial_pod_saves_its_output_there(fake_k8s: FakeK8s) -> None:
    job = TrainJob(name="trial", image="img", train_args=BASE_ARGS, workspace_pvc="ws")
    body = build_experiment(request(trial_job=job))
    env = trial_container(body)["env"]
    assert {"name": "KUBELLM_LOG_DIR", "value": str(trial_log_dir("llm-tune"))} in env
    assert {
        "name": "KUBELLM_POD_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    } in env
    assert fake_k8s.validate("experiments", body) == []


def test_counts_fit_katibs_limits(fake_k8s: FakeK8s) -> None:
    body = build_experiment(request(max_trials=3, parallel_trials=8, max_failed_trials=10))
    spec = body["spec"]
    assert (spec["parallelTrialCount"], spec["maxFailedTrialCount"]) == (3, 3)
    assert fake_k8s.validate("experiments", body) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"space": []}, "search space is empty"),
        ({"max_trials": 0}, "max_trials"),
    ],
)
def test_requests_katib_would_reject_fail_early(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_experiment(request(**overrides))


def test_success_returns_the_optimal_trial_and_the_trials(
    fake_k8s: FakeK8s, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_k8s.script_status("experiments", "llm-tune", [RUNNING, SUCCEEDED])
    fake_k8s.on_create("experiments", add_trials)

    result = KatibTuner(fake_k8s.api_client(), poll_interval_s=POLL_S).tune(request())

    assert result.best_trial == "llm-tune-abcd1234"
    assert result.best_params == {"learning_rate": 0.0031, "batch_size": 32.0}
    assert result.best_value == 1.25
    assert [(t.name, t.state, t.value) for t in result.trials] == [
        ("llm-tune-abcd1234", "succeeded", 1.25),
        ("llm-tune-efgh5678", "failed", None),
    ]
    assert result.trials[1].params == {"learning_rate": 0.009, "batch_size": 8.0}
    assert fake_k8s.errors == []
    assert len(fake_k8s.created("experiments")) == 1
    assert "experiment/llm-tune: Succeeded" in capsys.readouterr().out


def test_success_without_an_objective_value_is_an_error(fake_k8s: FakeK8s) -> None:
    no_best = {**SUCCEEDED, "currentOptimalTrial": {"observation": {"metrics": []}}}
    fake_k8s.script_status("experiments", "llm-tune", [no_best])
    with pytest.raises(JobFailed, match="without a trial that reported eval_loss"):
        KatibTuner(fake_k8s.api_client(), poll_interval_s=POLL_S).tune(request())


def test_failed_experiment_raises_with_reason(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("experiments", "llm-tune", [RUNNING, FAILED])

    with pytest.raises(
        JobFailed, match="ExperimentFailed: Experiment has failed because max failed count"
    ) as info:
        KatibTuner(fake_k8s.api_client(), poll_interval_s=POLL_S).tune(request())

    assert not isinstance(info.value, JobTimeout)
    assert "max failed count" in str(info.value)
    assert fake_k8s.errors == []


def test_timeout_deletes_the_experiment(fake_k8s: FakeK8s) -> None:
    fake_k8s.script_status("experiments", "llm-tune", [RUNNING])
    start = time.monotonic()

    with pytest.raises(JobTimeout, match=r"experiment/llm-tune .*within 0.3s"):
        KatibTuner(fake_k8s.api_client(), poll_interval_s=POLL_S).tune(request(timeout_s=0.3))

    assert time.monotonic() - start < 3.0
    assert ("experiments", "default", "llm-tune") in fake_k8s.deleted


@pytest.mark.parametrize(
    "metrics",
    [
        {"eval_loss": 1.2345678, "perplexity": 3.43},
        {"eval_loss": 1e-05, "step": 120.0},
        {"loss": -0.5, "eval_loss": 12345678.0},  # exponent form at 6 significant digits
    ],
)
def test_katibs_stdout_collector_reads_the_trainers_lines(metrics: dict[str, float]) -> None:
    """Katib's StdOut collector parses trial output with its default filter
    (`([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)`, pkg/metricscollector); the
    value it reports must be the value kubellm's own parser reads from the same line."""
    from fakes.katib_controller import parse_metrics as katib_parse
    from kubellm.train.metric_lines import format_metrics, parse_metrics

    log = f"train: 120/120 steps 0.8s\n{format_metrics(metrics)}\n"
    ours = parse_metrics(log)
    katib = katib_parse(log, list(metrics))
    for name in metrics:
        assert float(katib[name][-1]) == pytest.approx(ours[name], rel=1e-6), name


# ---------------------------------------------------------------- on the simulated cluster


@pytest.fixture
def sim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimCluster]:
    with SimCluster(tmp_path / "cluster", grace_cap_s=30.0) as cluster:
        # the step and the trial pods see the workspace PVC at the same path
        monkeypatch.setenv("KUBELLM_WORKSPACE_MOUNT", str(cluster.pvc_dir(WORKSPACE_PVC)))
        yield cluster
        assert cluster.errors == [] and cluster.fake.errors == []
        assert cluster.fake.forbidden == []


def sim_request(job: TrainJob, **overrides: Any) -> TuneRequest:
    return request(
        trial_job=job,
        space=[SearchParam("learning_rate", 1e-3, 2e-3)],
        max_trials=1,
        parallel_trials=1,
        algorithm="random",
        timeout_s=240.0,
        **overrides,
    )


def test_a_failed_trials_last_lines_are_printed_by_the_step(
    sim: SimCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under Katib's wrapper the trial's training container log is empty and its pods go
    with the trial: the step prints the failed trial's output from the workspace PVC."""
    job = TrainJob(
        name="trial",
        image="img",
        module="json.tool",  # a worker that fails at once, without torch: no such file
        train_args=["/no/such/input.json"],
        nproc_per_node=1,
        workspace_pvc=WORKSPACE_PVC,
    )
    with pytest.raises(JobFailed, match="max failed count"):
        KatibTuner(sim.api_client(), poll_interval_s=0.2).tune(sim_request(job))
    out = capsys.readouterr().out
    (trial,) = sim.fake.list_objects("trials")
    name = trial["metadata"]["name"]
    saved = trial_log_dir("llm-tune") / f"{name}-master-0.log"
    assert f"trial/{name} Failed: TrialFailed. Job reason: PyTorchJobFailed" in out, out
    assert "last " in out and f" lines of {saved}:" in out, out
    assert re.search(r"  \| .*/no/such/input\.json", out), out  # the worker's own error
    assert "  | launch: workers failed; exiting with 2" in out, out  # argparse: 2
    # what the pod's collector read: the same output, in the metrics file, not the pod log
    # (the pod is gone with the trial; its emptyDir is the kubelet's pods/<pod>-<uid>/volumes)
    (metrics,) = sim.tmp_path.glob(f"pods/default/{name}-master-0-*/volumes/*/metrics-volume")
    assert "/no/such/input.json" in (metrics / "metrics.log").read_text()


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("katib-ds")
    prepare(PrepareParams(num_records=500, vocab_size=300, seq_len=16), out)
    return out


def test_a_deleted_trial_pod_checkpoints_under_katibs_wrapper(
    sim: SimCluster, small_dataset: Path
) -> None:
    """Deleting the trial's master pod: the kubelet's SIGTERM reaches Katib's `sh` only
    (shareProcessNamespace), and the runtime SIGKILLs the rest of the container once that
    `sh` exits. The trial shell passes the SIGTERM to the agent and waits: the workers
    checkpoint and the container exits 200 (EXIT_PREEMPTED)."""
    pvc = sim.pvc_dir(WORKSPACE_PVC)
    ckpt = pvc / "ckpt"
    cfg = TrainConfig.model_validate(
        {
            "dataset_dir": str(small_dataset),
            "output_dir": str(pvc / "out"),
            "steps": 100_000,  # only the signal ends it
            "batch_size": 8,
            "log_every": 20,
            "eval_batches": 1,
            "checkpoint_dir": str(ckpt),
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        }
    )
    config = pvc / "trial.json"
    config.write_text(json.dumps(cfg.model_dump()))
    job = TrainJob(
        name="trial",
        image="img",
        train_args=["--config", str(config)],
        nproc_per_node=1,
        workspace_pvc=WORKSPACE_PVC,
    )
    sim.fake.create_object("experiments", build_experiment(sim_request(job)))
    trial = sim.wait_for(lambda: sim.fake.list_objects("trials"), 30, "a trial")[0]
    master = f"{trial['metadata']['name']}-master-0"
    pod = sim.wait_for(lambda: sim.fake.get_object("pods", master), 30, "the master pod")
    assert pod["spec"]["shareProcessNamespace"] is True
    metrics = sim.kubelet.empty_dir(pod, "metrics-volume") / "metrics.log"  # what Katib reads
    sim.wait_for(
        lambda: metrics.is_file() and re.search(r"^step=40 ", metrics.read_text(), re.M),
        180,
        "training past step 40",
    )
    assert sim.fake.pod_log("default", master) == ""  # Katib's wrapper: stdout is the file
    main = sim.kubelet.main_pid(pod)  # Katib's `sh`
    assert main is not None
    sim.fake.delete_object("pods", master)  # pre-emption: the kubelet stops the container
    sim.wait_for(lambda: _gone(main), 60, "the container stopped")
    output = metrics.read_text()
    stopped = re.search(r"pre-empted by SIGTERM after step (\d+) \(checkpoint written\)", output)
    assert stopped, output[-3000:]
    assert f"step-{int(stopped.group(1)):08d}" in [p.name for p in complete_checkpoints(ckpt)]
    assert "exiting with 200 (retryable)" in output
    saved = trial_log_dir("llm-tune") / f"{master}.log"  # the copy on the workspace PVC
    assert stopped.group(0) in saved.read_text()


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie has)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
