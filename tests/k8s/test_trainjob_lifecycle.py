"""TrainJobTrainer: a TrainJob's whole life on the simulated cluster, with the same guarantees
test_job_lifecycle.py proves for PyTorchJobs.

The simulated Trainer v2.3.0 (fakes/trainer_v2.py) and JobSet v0.12.0 with its Indexed Jobs
(fakes/jobset.py) run the TrainJob on the ClusterTrainingRuntime we ship
(manifests/cluster/trainer-v2/clustertrainingruntime.yaml, loaded as a cluster administrator
applies it); its node pods are local processes whose output is their log. The repo's Role
(manifests/base) is enforced on every request the step makes: each test ends with nothing
forbidden, no controller error and no schema error.

The TrainJob is the one TrainJobTrainer builds, with its `node` command swapped for a tiny
python program (the real agent takes seconds to start under torchrun). What is proven:
node 0's log echoed live (node 1's not), a crash failing the step with the TrainJob's reason
and the traceback, a retryable exit restarting the JobSet (bounded by the runtime's
maxRestarts), the timeout and a stop deleting the TrainJob with every pod process, a
retried step adopting its running TrainJob or replacing a finished one, and a TrainJob held
suspended (as Kueue holds it) waiting with its timeout not running.
"""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fakes.sim_cluster import SimCluster
from kubellm.backends.base import JobFailed, JobResult, JobTimeout, TrainJob
from kubellm.backends.kubernetes import client, trainjob
from kubellm.backends.kubernetes.client import JobStopped, prepare_body
from kubellm.backends.kubernetes.trainjob import TrainJobTrainer

from .conftest import POLL_S
from .test_job_lifecycle import Echo, _alive, job_requests, until

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "manifests" / "cluster" / "trainer-v2" / "clustertrainingruntime.yaml"
NS = "default"
IMAGE = "ghcr.io/kubellm/trainer:0.1.0"
TJ_PATH = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimCluster]:
    with SimCluster(tmp_path) as cluster:  # the repo's Role
        doc = yaml.safe_load(RUNTIME.read_text())
        cluster.fake.create_object("clustertrainingruntimes", doc)  # as a cluster admin
        yield cluster
        assert cluster.errors == []
        assert cluster.fake.errors == []
        assert cluster.fake.forbidden == []


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Echo:
    """What the step prints (KubeClient.run's default echo), recorded as it comes."""
    lines = Echo()
    monkeypatch.setattr(client, "_print_line", lines)
    return lines


def swap_command(monkeypatch: pytest.MonkeyPatch, code: str, **spec: Any) -> None:
    """TrainJobTrainer's TrainJobs run `python -c code` on every node, `spec` added."""
    real = trainjob.trainjob_manifest

    def manifest(job: TrainJob, cluster: Any = None) -> dict[str, Any]:
        body = real(job, cluster)
        body["spec"]["trainer"]["command"] = ["python", "-c", textwrap.dedent(code)]
        body["spec"]["trainer"].pop("args", None)
        body["spec"].update(spec)
        return body

    monkeypatch.setattr(trainjob, "trainjob_manifest", manifest)


def train_job(name: str, nnodes: int = 2, timeout_s: float = 30.0, **env: str) -> TrainJob:
    return TrainJob(
        name=name, train_args=[], image=IMAGE, nnodes=nnodes, timeout_s=timeout_s, env=env
    )


def trainer(sim: SimCluster) -> TrainJobTrainer:
    return TrainJobTrainer(sim.api_client(), poll_interval_s=POLL_S)


def node_pods(sim: SimCluster, name: str, rank: int | None = None) -> list[dict[str, Any]]:
    """The TrainJob's node pods now (those of node `rank` only, when given)."""
    prefix = f"{name}-node-0-" + ("" if rank is None else f"{rank}-")
    return [
        p for p in sim.fake.list_objects("pods", NS) if p["metadata"]["name"].startswith(prefix)
    ]


def pods_added(sim: SimCluster, name: str, rank: int) -> list[str]:
    """Every node-`rank` pod ever created, in order."""
    prefix = f"{name}-node-0-{rank}-"
    return [
        e.obj["metadata"]["name"]
        for e in sim.fake.history("pods")
        if e.type == "ADDED" and e.obj["metadata"]["name"].startswith(prefix)
    ]


def trainjob_requests(sim: SimCluster) -> list[str]:
    """The step's requests on the TrainJob API: POST, DELETE, GET (one), LIST, WATCH."""
    return job_requests(sim.fake, TJ_PATH)


def all_gone(sim: SimCluster, name: str) -> None:
    """The TrainJob and everything it made are deleted (the garbage collector's cascade)."""
    assert sim.fake.get_object("trainjobs", name, NS) is None
    until(lambda: sim.fake.get_object("jobsets", name, NS) is None, "the JobSet to go")
    until(
        lambda: (
            not [
                j
                for j in sim.fake.list_objects("jobs", NS)
                if j["metadata"]["name"].startswith(f"{name}-")
            ]
        ),
        "its Jobs to go",
    )
    until(lambda: not node_pods(sim, name), "its pods to go")


def pids_end(pid_dir: Path) -> None:
    pids = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert pids
    for pid in pids:
        until(lambda pid=pid: not _alive(pid), f"process {pid} to end", timeout=10)


# The node's rank: the torch plugin's PET_NODE_RANK (the Job's completion index).
RANK = "rank = int(os.environ['PET_NODE_RANK'])"


# ---------------------------------------------------------------------- running to the end

LIVE = f"""
    import os, pathlib, sys, time
    {RANK}
    print(f"node {{rank}} step=1 loss=2.5", flush=True)
    shown = pathlib.Path(os.environ["SHOWN"])
    deadline = time.time() + 10
    while not shown.exists():  # until the step has printed node 0's first line
        if time.time() > deadline:
            sys.exit("the step never showed node 0's first line")
        time.sleep(0.02)
    print(f"node {{rank}} eval_loss=1.75", flush=True)
"""


def test_node0s_log_is_echoed_live_and_node1s_is_not(
    sim: SimCluster, echo: Echo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shown = tmp_path / "shown"
    swap_command(monkeypatch, LIVE)

    def record(line: str) -> None:
        echo(line)
        if line.endswith("] node 0 step=1 loss=2.5"):
            shown.touch()  # the nodes go on only once node 0's line is in the step's output

    monkeypatch.setattr(client, "_print_line", record)
    result = trainer(sim).run(train_job("live", SHOWN=str(shown)))

    first = echo.index("] node 0 step=1 loss=2.5")
    # the state lines: Trainer v2.3 has no Running condition, so it comes from jobsStatus
    states = [
        i
        for i, line in enumerate(echo.lines)
        if line.startswith("trainjob/live: ") and "created" not in line
    ]
    assert states and states[0] < first, echo.lines
    assert any(echo.lines[i].startswith("trainjob/live: Running (node: ") for i in states)
    assert 0 <= first < echo.index("] node 0 eval_loss=1.75") < echo.index("live: Complete")
    (node0,) = pods_added(sim, "live", 0)
    assert echo.lines[first] == f"[{node0}] node 0 step=1 loss=2.5"
    (node1,) = pods_added(sim, "live", 1)
    assert "node 1 eval_loss=1.75" in sim.fake.pod_log(NS, node1)  # it ran and printed,
    assert echo.index("node 1") == -1  # but only node 0 is followed
    assert result.logs == "node 0 step=1 loss=2.5\nnode 0 eval_loss=1.75\n"
    assert result.metrics == {"step": 1.0, "loss": 2.5, "eval_loss": 1.75}
    assert sim.condition("trainjobs", "live", "Complete")
    assert echo.lines[-1] == "trainjob/live: Complete"


# ---------------------------------------------------------------------- failures

CRASH = f"""
    import os, time
    {RANK}
    if rank == 1:
        time.sleep(60)  # node 1 is still running when node 0 crashes
    for i in range(25):
        print(f"line {{i:02d}}", flush=True)
    raise RuntimeError("CUDA out of memory")
"""


def test_a_crash_fails_with_the_trainjobs_reason_and_the_traceback_without_a_restart(
    sim: SimCluster, echo: Echo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 1 (a traceback) is permanent: the runtime's podFailurePolicy fails the Job at
    once, its FailJobSet rule the JobSet, and the TrainJob is Failed with that reason."""
    swap_command(monkeypatch, CRASH)
    with pytest.raises(JobFailed) as info:
        trainer(sim).run(train_job("crash"))

    assert not isinstance(info.value, JobTimeout)
    msg = str(info.value)
    (node0,) = pods_added(sim, "crash", 0)
    assert msg.startswith(
        "trainjob/crash in default failed: FailJobSetFailurePolicyAction: applying FailJobSet "
        "failure policy action (first failed job: crash-node-0)"
    ), msg
    assert f"--- last lines of {node0} ---" in msg
    assert "Traceback (most recent call last):" in msg
    assert msg.endswith("RuntimeError: CUDA out of memory")
    assert "line 24" in msg and "line 00" not in msg  # the last 20 lines
    jobset = sim.fake.get_object("jobsets", "crash", NS)
    assert jobset is not None and jobset["status"].get("restarts", 0) == 0
    assert len(pods_added(sim, "crash", 0)) == 1  # no new pod: no restart
    assert sim.fake.get_object("trainjobs", "crash", NS) is not None  # kept for a look
    until(lambda: not node_pods(sim, "crash", 1), "node 1's pod to go (the Job failed)")


RETRY = f"""
    import os, pathlib, sys, time
    {RANK}
    count = pathlib.Path(os.environ["COUNT"]) / str(rank)
    attempt = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(attempt))
    print(f"attempt {{attempt}}", flush=True)
    shown = pathlib.Path(os.environ["SHOWN"])
    deadline = time.time() + 10
    while rank == 0 and attempt == 1 and not shown.exists() and time.time() < deadline:
        time.sleep(0.02)  # so the step has seen this pod before it is replaced
    print(f"eval_loss={{attempt}}.5", flush=True)
    sys.exit(200 if rank == 0 and attempt == 1 else 0)  # 200: retryable (no FailJob rule)
"""


def test_a_retryable_exit_restarts_the_jobset_and_the_new_node0_is_followed(
    sim: SimCluster, echo: Echo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "count").mkdir()
    shown = tmp_path / "shown"
    swap_command(monkeypatch, RETRY)

    def record(line: str) -> None:
        echo(line)
        if line.endswith("] attempt 1"):
            shown.touch()

    monkeypatch.setattr(client, "_print_line", record)
    result = trainer(sim).run(train_job("retry", COUNT=str(tmp_path / "count"), SHOWN=str(shown)))

    first, second = pods_added(sim, "retry", 0)  # a new pod, another name
    assert first != second
    assert 0 <= echo.index(f"[{first}] attempt 1") < echo.index(f"[{second}] attempt 2")
    assert result.logs == "attempt 1\neval_loss=1.5\nattempt 2\neval_loss=2.5\n"
    assert result.metrics == {"eval_loss": 2.5}  # the last value
    jobset = sim.fake.get_object("jobsets", "retry", NS)
    assert jobset is not None and jobset["status"]["restarts"] == 1
    assert sim.condition("trainjobs", "retry", "Complete")


def test_a_trainjob_that_keeps_exiting_retryably_fails_after_max_restarts(
    sim: SimCluster, echo: Echo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime's failurePolicy.maxRestarts (3): four runs, then ReachedMaxRestarts."""
    swap_command(monkeypatch, "print('attempt', flush=True); raise SystemExit(200)")
    with pytest.raises(JobFailed) as info:
        trainer(sim).run(train_job("flaky", nnodes=1))

    msg = str(info.value)
    assert msg.startswith(
        "trainjob/flaky in default failed: ReachedMaxRestarts: jobset failed due to reaching "
        "max number of restarts (first failed job: flaky-node-0)"
    ), msg
    runs = pods_added(sim, "flaky", 0)
    assert len(runs) == 3 + 1
    assert f"--- last lines of {runs[-1]} ---\nattempt" in msg
    jobset = sim.fake.get_object("jobsets", "flaky", NS)
    assert jobset is not None and jobset["status"]["restarts"] == 3


# ---------------------------------------------------------------------- stops

SLEEPER = """
    import os, pathlib, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as the agent: it checkpoints
    pathlib.Path(os.environ["PIDS"], os.environ["PET_NODE_RANK"]).write_text(str(os.getpid()))
    print("alive", flush=True)
    time.sleep(60)
"""


def test_the_timeout_deletes_the_trainjob_and_every_node_process(
    sim: SimCluster, echo: Echo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    swap_command(monkeypatch, SLEEPER)
    # The TrainJob's own activeDeadlineSeconds (Trainer v2 requeues it at the deadline) comes
    # DEADLINE_GRACE_S after the step's: the step's timeout deletes it, and says so.
    start = time.monotonic()
    with pytest.raises(JobTimeout) as info:
        trainer(sim).run(train_job("slow", timeout_s=2.0, PIDS=str(pids)))

    assert time.monotonic() - start < 6
    msg = str(info.value)
    assert msg.startswith("trainjob/slow in default did not finish within 2s"), msg
    assert "; it has been deleted" in msg and msg.endswith("alive")
    assert ("trainjobs", NS, "slow") in sim.fake.deleted
    assert trainjob_requests(sim)[-1] == "DELETE"
    all_gone(sim, "slow")
    assert len(list(pids.iterdir())) == 2
    pids_end(pids)


def test_a_stopped_step_deletes_the_trainjob_and_leaves_no_process_behind(
    sim: SimCluster, echo: Echo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As Argo stops a step: SIGTERM to the step's process (here, this one: a guard handler
    catches a SIGTERM that run() did not, instead of ending pytest)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    swap_command(monkeypatch, SLEEPER)

    def stop_when_alive() -> None:
        if echo.wait_for("] alive", timeout=15):
            until(lambda: len(list(pids.iterdir())) == 2, "both nodes")
            os.kill(os.getpid(), signal.SIGTERM)

    stray: list[int] = []

    def guard(signum: int, frame: object) -> None:
        stray.append(signum)

    previous = signal.signal(signal.SIGTERM, guard)
    try:
        killer = threading.Thread(target=stop_when_alive, daemon=True)
        killer.start()
        with pytest.raises(JobStopped) as info:
            trainer(sim).run(train_job("sleeper", PIDS=str(pids)))
        killer.join(5)
        assert signal.getsignal(signal.SIGTERM) is guard  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)

    assert stray == []
    assert info.value.code == 143
    assert "trainjob/sleeper in default: the step was stopped (SIGTERM)" in str(info.value)
    assert "the job has been deleted" in str(info.value)
    assert trainjob_requests(sim)[-1] == "DELETE"
    all_gone(sim, "sleeper")
    pids_end(pids)


# ---------------------------------------------------------------------- retried steps


class StepKilled(BaseException):
    """The step's pod vanished mid-run (SIGKILL, a lost node): no cleanup at all."""


GATED = f"""
    import os, pathlib, sys, time
    {RANK}
    print(f"node {{rank}} up", flush=True)
    gate = pathlib.Path(os.environ["GATE"])
    deadline = time.time() + 20
    while not gate.exists():
        if time.time() > deadline:
            sys.exit("never let go")
        time.sleep(0.02)
    print("eval_loss=1.5", flush=True)
"""


def test_a_retried_step_adopts_its_running_trainjob(
    sim: SimCluster, echo: Echo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    swap_command(monkeypatch, GATED)
    job = train_job("again", GATE=str(gate))

    def killed_when_running(line: str) -> None:
        echo(line)
        # A status line, on the step's main thread, once node 0 runs: the step dies there.
        state = line.startswith("trainjob/again: ") and "created" not in line
        if state and echo.wait_for("] node 0 up", timeout=15):
            raise StepKilled

    monkeypatch.setattr(client, "_print_line", killed_when_running)
    with pytest.raises(StepKilled):
        trainer(sim).run(job)
    first = sim.fake.get_object("trainjobs", "again", NS)
    assert first is not None  # the first attempt left its TrainJob running
    (node0,) = pods_added(sim, "again", 0)

    def let_go(line: str) -> None:
        echo(line)
        if "adopted" in line:
            gate.touch()

    monkeypatch.setattr(client, "_print_line", let_go)
    echo.lines.clear()
    result = trainer(sim).run(job)

    assert "trainjob/again: adopted the one already in default" in echo.lines[0]
    assert "same spec" in echo.lines[0]
    tj = sim.fake.get_object("trainjobs", "again", NS)
    assert tj is not None and tj["metadata"]["uid"] == first["metadata"]["uid"]
    assert [e.type for e in sim.fake.history("trainjobs")].count("ADDED") == 1  # never two
    assert pods_added(sim, "again", 0) == [node0]  # the same pod, its whole log
    assert result.logs == "node 0 up\neval_loss=1.5\n"
    calls = trainjob_requests(sim)
    assert calls.count("POST") == 2 and "DELETE" not in calls  # the second answered 409


MODE = """
    import os, pathlib, sys
    mode = pathlib.Path(os.environ["MODE"]).read_text()
    print(f"eval_loss={0.5 if mode == 'ok' else 9.5}", flush=True)
    sys.exit(0 if mode in ("ok", "finished") else 2)  # 2: permanent (bad config)
"""


@pytest.mark.parametrize("earlier", ["failed", "finished"])
def test_a_retried_step_replaces_a_finished_or_failed_trainjob(
    earlier: str,
    sim: SimCluster,
    echo: Echo,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The same spec (what the step would create), but the earlier attempt's TrainJob has
    ended: it is deleted and created anew, and the new one's node 0 is what the step reads."""
    mode = tmp_path / "mode"
    mode.write_text(earlier)
    swap_command(monkeypatch, MODE)
    job = train_job("redo", nnodes=1, MODE=str(mode))
    sim.fake.create_object("trainjobs", prepare_body(trainjob.trainjob_manifest(job), NS), NS)
    done = "Failed" if earlier == "failed" else "Complete"
    sim.wait_for(lambda: sim.condition("trainjobs", "redo", done), 20, done)
    old = sim.fake.get_object("trainjobs", "redo", NS)
    assert old is not None
    (old_pod,) = pods_added(sim, "redo", 0)

    mode.write_text("ok")
    result = trainer(sim).run(job)

    says = "it failed (FailJobSetFailurePolicyAction" if earlier == "failed" else "it already"
    assert f"trainjob/redo: already in default but {says}" in echo.lines[0], echo.lines[0]
    assert "deleting it to create it again" in echo.lines[0]
    assert result.metrics == {"eval_loss": 0.5}
    assert result.logs == "eval_loss=0.5\n"  # the new pod's log, not the old one's
    new = sim.fake.get_object("trainjobs", "redo", NS)
    assert new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]
    assert sim.condition("trainjobs", "redo", "Complete")
    calls = trainjob_requests(sim)
    assert calls[:3] == ["POST", "GET", "DELETE"] and calls.count("POST") == 2
    runs = pods_added(sim, "redo", 0)
    assert runs[0] == old_pod and len(runs) == 2


# ---------------------------------------------------------------------- queues


def test_a_suspended_trainjobs_timeout_does_not_run_while_it_waits(
    sim: SimCluster, echo: Echo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TrainJob created suspended (as Kueue's webhook creates it) has no JobSet pods and
    keeps its whole timeout until it is resumed; then it runs and succeeds."""
    swap_command(monkeypatch, "print('eval_loss=1.5', flush=True)", suspend=True)
    admitted: list[int] = []  # the resourceVersion at admission

    def admit() -> None:
        sim.wait_for(lambda: sim.condition("trainjobs", "queued", "Suspended"), 10, "Suspended")
        time.sleep(2.5)  # longer than the timeout
        assert sim.fake.list_objects("pods") == []
        obj = sim.fake.get_object("trainjobs", "queued")
        assert obj is not None
        obj["spec"]["suspend"] = False  # what Kueue does on admission
        admitted.append(sim.fake.resource_version)
        sim.fake.put_object("trainjobs", obj)

    admitter = threading.Thread(target=admit, daemon=True)
    admitter.start()
    result: JobResult = trainer(sim).run(train_job("queued", nnodes=1, timeout_s=2.0))
    admitter.join(5)

    assert admitted and result.metrics == {"eval_loss": 1.5}
    assert (
        0
        <= echo.index("trainjob/queued: waiting in a queue (suspended); the 2s timeout starts")
        < echo.index("trainjob/queued: admitted after")
    )
    pods = [e.rv for e in sim.fake.history("pods") if e.type == "ADDED"]
    assert pods and min(pods) > admitted[0]  # no pod before the admission
    assert sim.condition("trainjobs", "queued", "Complete")
