"""KubeClient.run: a job's whole life on the fake API server, with the Training Operator and the
kubelet played step by step by each test (watch events, live pod logs, cascade deletes and
the Role's RBAC are the fake's own).

What a pipeline step meets on a cluster: logs while the job runs, failures that explain
themselves, timeouts and stops that leave nothing running, retries of the step that find
the job already there, and an API server whose watches drop and expire.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from fakes.fake_k8s import FakeK8s
from fakes.sim_cluster import SimCluster
from kubellm.backends.base import JobFailed, JobTimeout, TrainJob
from kubellm.backends.kubernetes import pytorchjob
from kubellm.backends.kubernetes.client import (
    SPEC_HASH_ANNOTATION,
    JobStopped,
    KubeClient,
    RunOutcome,
    condition_is_true,
    prepare_body,
)
from kubellm.backends.kubernetes.pod_logs import PodLogs
from kubellm.backends.kubernetes.podspec import ClusterSettings
from kubellm.backends.kubernetes.pytorchjob import (
    CONTAINER,
    PYTORCHJOB,
    PyTorchJobTrainer,
    master_selector,
    pytorchjob_manifest,
    pytorchjob_queued,
)
from kubellm.train.metric_lines import parse_metrics

from .conftest import FAILED, POLL_S, RUNNING, SUCCEEDED

NS = "default"
NAME = "llm-train"
MASTER = f"{NAME}-master-0"
JOBS_PATH = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs"


def manifest(lr: str = "0.003") -> dict[str, Any]:
    return pytorchjob_manifest(
        TrainJob(
            name=NAME,
            image="ghcr.io/example/kubellm-trainer:test",
            train_args=["--config", "/workspace/run/train.json", "--set", f"learning_rate={lr}"],
        )
    )


def succeeded(obj: dict[str, Any]) -> bool:
    return condition_is_true(obj, "Succeeded")


class Echo:
    """The `echo` of a run: records every line, and lets a test wait for one."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()

    def __call__(self, line: str) -> None:
        with self._cond:
            self.lines.append(line)
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.index(text) >= 0, timeout)

    def index(self, text: str) -> int:
        """The position of the first line containing `text`, -1 if none."""
        return next((i for i, line in enumerate(self.lines) if text in line), -1)

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)


def until(predicate: Callable[[], Any], what: str, timeout: float = 5.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class Operator:
    """The Training Operator and the kubelet for PyTorchJobs in the fake: each created job
    gets its master pod (Pending, owned by the job); the test moves both on."""

    def __init__(self, fake: FakeK8s) -> None:
        self.fake = fake
        fake.on_create("pytorchjobs", self._add_master)

    def _add_master(self, fake: FakeK8s, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        fake.add_pod(
            NS,
            f"{name}-master-0",
            {
                "training.kubeflow.org/job-name": name,
                "training.kubeflow.org/replica-type": "master",
                "training.kubeflow.org/job-role": "master",
            },
            phase="Pending",
            owner=job,
            spec={"containers": [{"name": CONTAINER, "image": "img"}]},
        )

    def uid(self) -> str | None:
        obj = self.fake.get_object("pytorchjobs", NAME)
        return obj["metadata"]["uid"] if obj else None

    def created(self, other_than: str | None = None) -> str:
        """Wait for the job to exist (another one than `other_than`); its uid."""
        return str(until(lambda: (u := self.uid()) != other_than and u, "the job"))

    def start(self) -> None:
        self.fake.set_status("pytorchjobs", NAME, RUNNING)
        self.fake.set_pod_phase(NS, MASTER, "Running")

    def log(self, text: str) -> None:
        self.fake.append_log(NS, MASTER, text)

    def finish(self, ok: bool = True) -> None:
        self.fake.set_pod_phase(NS, MASTER, "Succeeded" if ok else "Failed")
        self.fake.set_status("pytorchjobs", NAME, SUCCEEDED if ok else FAILED)


@pytest.fixture
def operator(fake_k8s: FakeK8s) -> Operator:
    return Operator(fake_k8s)


def run(
    fake: FakeK8s,
    echo: Callable[[str], None] | None,
    timeout_s: float = 10.0,
    poll_s: float = POLL_S,
    log_container: str = CONTAINER,
    **kwargs: Any,
) -> RunOutcome:
    """KubeClient.run of the manifest, following the master's log.

    `poll_s` 0.5 makes the pause before a reconnect 0.2 s: room for a test to change the
    cluster after a drop and before the client is back."""
    body = kwargs.pop("body", None) or manifest()
    return KubeClient(fake.api_client(), poll_s).run(
        PYTORCHJOB,
        NS,
        body,
        timeout_s=timeout_s,
        done=succeeded,
        follow_logs=master_selector(NAME),
        log_container=log_container,
        echo=echo,
        **kwargs,
    )


def job_requests(fake: FakeK8s, path: str = JOBS_PATH) -> list[str]:
    """The requests on a job API (`path`, the PyTorchJobs' by default): `POST`, `DELETE`,
    `GET` (one), `LIST`, `WATCH`."""
    out = []
    for r in fake.requests:
        if not r.path.startswith(path):
            continue
        if r.method == "GET" and r.path == path:
            out.append("WATCH" if r.query.get("watch") else "LIST")
        else:
            out.append(r.method)
    return out


def watches(fake: FakeK8s) -> list[dict[str, list[str]]]:
    return [
        r.query
        for r in fake.requests
        if r.method == "GET" and r.path == JOBS_PATH and r.query.get("watch")
    ]


# ---------------------------------------------------------------------- running to the end


def test_log_lines_are_echoed_while_the_job_runs(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    echo = Echo()

    def story() -> None:
        operator.created()
        operator.start()
        operator.log("step=1 loss=2.5\n")
        # The job only finishes once the step has shown this line: a client that read the
        # log after the job ended would never show it in time.
        echo.wait_for(f"[{MASTER}] step=1 loss=2.5", timeout=3.0)
        operator.log("step=2 loss=2.0\neval_loss=1.75\n")
        operator.finish()

    play(story)
    outcome = run(fake_k8s, echo)

    shown = echo.index(f"[{MASTER}] step=1 loss=2.5")
    assert 0 <= shown < echo.index(f"pytorchjob/{NAME}: Succeeded")
    assert echo.index(f"pytorchjob/{NAME}: Running") < shown
    assert outcome.logs == "step=1 loss=2.5\nstep=2 loss=2.0\neval_loss=1.75\n"
    assert parse_metrics(outcome.logs) == {"step": 2.0, "loss": 2.0, "eval_loss": 1.75}
    assert outcome.obj["metadata"]["name"] == NAME and not outcome.adopted
    assert echo.count("eval_loss=1.75") == 1
    assert echo.count(f"pytorchjob/{NAME}: Running") == 1  # a line per change
    assert fake_k8s.errors == [] and fake_k8s.forbidden == []


def test_default_echo_prints_to_the_steps_stdout(
    fake_k8s: FakeK8s,
    operator: Operator,
    play: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    def story() -> None:
        operator.created()
        operator.start()
        operator.log("hello from the master\n")
        operator.finish()

    play(story)
    run(fake_k8s, None)

    out = capsys.readouterr().out
    assert f"[{MASTER}] hello from the master\n" in out
    assert f"pytorchjob/{NAME}: Succeeded\n" in out


def test_failure_quotes_the_condition_and_the_last_log_lines(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    def story() -> None:
        operator.created()
        operator.start()
        operator.log("".join(f"line {i:02d}\n" for i in range(25)))
        operator.log("RuntimeError: CUDA out of memory\n")
        operator.finish(ok=False)

    play(story)
    with pytest.raises(JobFailed) as info:
        run(fake_k8s, Echo())

    assert not isinstance(info.value, JobTimeout)
    msg = str(info.value)
    assert "PyTorchJobFailed: PyTorchJob default/llm-train is failed because 1 Master" in msg
    assert f"--- last lines of {MASTER} ---" in msg
    assert msg.endswith("RuntimeError: CUDA out of memory")
    assert "line 06" in msg and "line 05" not in msg  # 20 lines: 06..24 and the error
    assert fake_k8s.get_object("pytorchjobs", NAME) is not None  # kept for a look
    assert fake_k8s.forbidden == []


def test_a_restarted_pod_is_followed_too(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    echo = Echo()

    def story() -> None:
        operator.created()
        operator.start()
        operator.log("attempt 1\n")
        echo.wait_for("attempt 1", timeout=3.0)
        # The operator replaces a failed pod (restartPolicy ExitCode): same name, new uid.
        job = fake_k8s.get_object("pytorchjobs", NAME) or {}
        fake_k8s.delete_object("pods", MASTER)
        fake_k8s.add_pod(
            NS,
            MASTER,
            {
                "training.kubeflow.org/job-name": NAME,
                "training.kubeflow.org/replica-type": "master",
            },
            log="attempt 2\n",
            phase="Running",
            owner=job,
            spec={"containers": [{"name": CONTAINER, "image": "img"}]},
        )
        echo.wait_for("attempt 2", timeout=3.0)
        operator.finish()

    play(story)
    outcome = run(fake_k8s, echo)

    assert outcome.logs == "attempt 1\nattempt 2\n"
    assert echo.count(f"[{MASTER}] attempt 1") == 1 and echo.count(f"[{MASTER}] attempt 2") == 1


def test_a_log_that_cannot_be_read_is_reported_not_retried_forever(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    def story() -> None:
        operator.created()
        operator.start()
        operator.log("eval_loss=1.5\n")
        until(lambda: any(r.path.endswith("/log") for r in fake_k8s.requests), "a log read")
        operator.finish()

    play(story)
    start = time.monotonic()
    outcome = run(fake_k8s, Echo(), log_container="trainer")  # the pod has only `pytorch`

    assert time.monotonic() - start < 3
    assert succeeded(outcome.obj) and outcome.logs == ""
    assert outcome.log_error is not None
    assert "HTTP 400 container trainer is not valid for pod llm-train-master-0" in outcome.log_error


# ---------------------------------------------------------------------- stops


def test_timeout_deletes_the_job(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    def story() -> None:
        operator.created()
        operator.start()
        operator.log("still warming up\n")

    play(story)
    start = time.monotonic()
    with pytest.raises(JobTimeout) as info:
        run(fake_k8s, Echo(), timeout_s=1.0)

    assert time.monotonic() - start < 3.0
    assert "did not finish within 1s (last state: Running); it has been deleted" in str(info.value)
    assert "still warming up" in str(info.value)
    assert ("pytorchjobs", NS, NAME) in fake_k8s.deleted
    assert fake_k8s.get_object("pytorchjobs", NAME) is None
    assert fake_k8s.get_object("pods", MASTER) is None  # the cascade took its pod
    assert fake_k8s.forbidden == []


def test_sigterm_deletes_the_job_and_restores_the_handler(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    """The signal goes to this process, so a guard handler is installed first: a SIGTERM that
    run() did not catch lands there (and fails the test) instead of ending pytest."""
    stray: list[int] = []

    def guard(signum: int, frame: FrameType | None) -> None:
        stray.append(signum)

    echo = Echo()

    def story() -> None:
        operator.created()
        operator.start()
        if echo.wait_for(f"pytorchjob/{NAME}: Running"):
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, guard)
    try:
        play(story)
        with pytest.raises(JobStopped) as info:
            run(fake_k8s, echo)
        assert signal.getsignal(signal.SIGTERM) is guard  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)

    assert stray == []
    assert info.value.code == 143
    assert "stopped (SIGTERM)" in str(info.value) and "deleted" in str(info.value)
    assert fake_k8s.get_object("pytorchjobs", NAME) is None
    assert job_requests(fake_k8s)[-1] == "DELETE"


CHILD = """
import json, sys
from kubernetes import client as k8s
from kubellm.backends.kubernetes.client import KubeClient, condition_is_true
from kubellm.backends.kubernetes.pytorchjob import PYTORCHJOB

cfg = k8s.Configuration()
cfg.host = sys.argv[1]
KubeClient(k8s.ApiClient(cfg), 0.05).run(
    PYTORCHJOB, "default", json.loads(sys.argv[2]), timeout_s=60,
    done=lambda o: condition_is_true(o, "Succeeded"),
)
print("not reached", flush=True)
"""


def test_a_stopped_step_deletes_its_job_and_exits_143(
    fake_k8s: FakeK8s, operator: Operator, tmp_path: Path
) -> None:
    """As Argo stops a step: SIGTERM to the step's process."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, fake_k8s.url, json.dumps(manifest())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        operator.created()
        operator.start()
        until(lambda: len(watches(fake_k8s)) >= 1, "the child's watch", timeout=20)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()

    assert child.returncode == 143, err
    assert "pytorchjob/llm-train in default: the step was stopped (SIGTERM)" in err
    assert "not reached" not in out
    assert fake_k8s.get_object("pytorchjobs", NAME) is None
    assert fake_k8s.forbidden == []


def test_ctrl_c_deletes_the_job(fake_k8s: FakeK8s, operator: Operator) -> None:
    def echo(line: str) -> None:
        if line == f"pytorchjob/{NAME}: Running":
            raise KeyboardInterrupt  # as Ctrl-C lands in the main thread, mid-wait

    # The job is Running as soon as it exists.
    fake_k8s.on_create("pytorchjobs", lambda f, o: f.set_status("pytorchjobs", NAME, RUNNING))
    with pytest.raises(KeyboardInterrupt):
        run(fake_k8s, echo)

    assert fake_k8s.get_object("pytorchjobs", NAME) is None
    assert job_requests(fake_k8s)[-1] == "DELETE"


# ---------------------------------------------------------------------- retried steps


class StepKilled(BaseException):
    """The step's pod vanished mid-run (SIGKILL, a lost node): no cleanup at all."""


def test_a_retried_step_adopts_its_running_job(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    def killed_when_running(line: str) -> None:
        if line.endswith(": Running"):
            raise StepKilled

    fake_k8s.on_create("pytorchjobs", lambda f, o: f.set_status("pytorchjobs", NAME, RUNNING))
    with pytest.raises(StepKilled):
        run(fake_k8s, killed_when_running)
    first = operator.uid()
    assert first is not None  # the first attempt left its job running

    echo = Echo()

    def story() -> None:
        fake_k8s.set_pod_phase(NS, MASTER, "Running")
        operator.log("step=1 loss=2.5\n")
        if echo.wait_for("adopted"):
            operator.log("step=2 loss=2.0\n")
            operator.finish()

    play(story)
    outcome = run(fake_k8s, echo)

    assert outcome.adopted
    assert outcome.obj["metadata"]["uid"] == first  # the same job, never a second one
    assert outcome.logs == "step=1 loss=2.5\nstep=2 loss=2.0\n"  # the whole log, from the start
    assert job_requests(fake_k8s).count("POST") == 2  # the second answered 409, handled
    assert "DELETE" not in job_requests(fake_k8s)
    assert "adopted the one already in default (Running, same spec)" in echo.lines[0]
    assert fake_k8s.forbidden == []


@dataclass
class ExistingCase:
    name: str
    status: dict[str, Any] | None
    body: dict[str, Any]  # what the earlier attempt created
    replace_terminal: bool
    adopted: bool
    says: str


EXISTING_CASES = [
    ExistingCase("running-same-spec", RUNNING, manifest(), True, True, "adopted"),
    ExistingCase("failed", FAILED, manifest(), True, False, "it failed (PyTorchJobFailed"),
    ExistingCase("failed-kept-terminal", FAILED, manifest(), False, False, "it failed"),
    ExistingCase("finished", SUCCEEDED, manifest(), True, False, "it already finished"),
    ExistingCase("finished-reused", SUCCEEDED, manifest(), False, True, "adopted"),
    ExistingCase("other-spec", RUNNING, manifest(lr="0.1"), True, False, "its spec differs"),
    ExistingCase("made-by-hand", RUNNING, {}, True, False, "not created from this spec"),
]


@pytest.mark.parametrize("case", EXISTING_CASES, ids=lambda c: c.name)
def test_an_existing_job_is_adopted_or_replaced(
    case: ExistingCase, fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    earlier = prepare_body(case.body or manifest(), NS)
    if not case.body:
        del earlier["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    fake_k8s.create_object("pytorchjobs", earlier, NS)
    fake_k8s.set_status("pytorchjobs", NAME, case.status or {})
    old = operator.uid()
    echo = Echo()

    def story() -> None:
        if case.adopted:
            echo.wait_for("adopted")
        else:
            operator.created(other_than=old)
        operator.start()
        operator.finish()

    play(story)
    outcome = run(fake_k8s, echo, replace_terminal=case.replace_terminal)

    assert case.says in echo.lines[0]
    assert outcome.adopted is case.adopted
    calls = job_requests(fake_k8s)
    if case.adopted:
        assert outcome.obj["metadata"]["uid"] == old
        assert calls.count("POST") == 1 and "DELETE" not in calls
    else:
        assert outcome.obj["metadata"]["uid"] != old
        # 409, then the old one is deleted (and seen gone) before the create that succeeds
        assert calls[:3] == ["POST", "GET", "DELETE"] and calls.count("POST") == 2
        assert calls.index("DELETE") < len(calls) - 1 - calls[::-1].index("POST")
        assert fake_k8s.created("pytorchjobs")[-1]["spec"] == manifest()["spec"]
    assert fake_k8s.errors == [] and fake_k8s.forbidden == []


def test_a_job_still_being_deleted_is_waited_for_before_the_create(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    """The foreground deletion of an earlier job takes as long as its pods take to stop; its
    name is free only when it is gone."""
    leaving = prepare_body(manifest(), NS)
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    leaving["metadata"]["finalizers"] = ["foregroundDeletion"]
    fake_k8s.put_object("pytorchjobs", leaving)
    old = operator.uid()
    echo = Echo()
    gone_at: list[int] = []

    def story() -> None:
        if echo.wait_for("it is being deleted"):
            until(lambda: watches(fake_k8s), "the client's watch")
            time.sleep(0.3)  # its pods take a while
            gone_at.append(len(fake_k8s.requests))
            fake_k8s.delete_object("pytorchjobs", NAME)
        operator.created(other_than=old)
        operator.start()
        operator.finish()

    play(story)
    outcome = run(fake_k8s, echo)

    assert outcome.obj["metadata"]["uid"] != old and not outcome.adopted
    posts = [i for i, r in enumerate(fake_k8s.requests) if r.method == "POST"]
    assert len(posts) == 2 and posts[-1] >= gone_at[0]  # created only once it was gone
    assert "DELETE" not in job_requests(fake_k8s)  # already on its way: not deleted again


# ---------------------------------------------------------------------- an unreliable API


def test_a_dropped_watch_resumes_from_its_resource_version(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    echo = Echo()

    def story() -> None:
        operator.created()
        operator.start()
        operator.log("before the drop\n")
        if echo.wait_for(f"pytorchjob/{NAME}: Running") and echo.wait_for("before the drop"):
            fake_k8s.drop_watches()  # mid-stream, as when the API server restarts
            # Before the client is back: only a watch from where it was sees this.
            operator.log("after the drop\n")
            operator.finish()

    play(story)
    outcome = run(fake_k8s, echo, poll_s=0.5)

    assert echo.index(f"pytorchjob/{NAME}: Succeeded") >= 0
    calls = job_requests(fake_k8s)
    assert calls.count("LIST") == 1, calls  # resumed, not re-listed
    versions = [int(q["resourceVersion"][0]) for q in watches(fake_k8s)]
    assert len(versions) >= 2 and versions == sorted(versions)
    assert outcome.logs == "before the drop\nafter the drop\n"  # the log stream resumed too
    assert echo.count("before the drop") == 1  # without repeating itself
    assert fake_k8s.forbidden == []


def test_an_expired_resource_version_lists_again(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    echo = Echo()

    def story() -> None:
        operator.created()
        operator.start()
        if echo.wait_for(f"pytorchjob/{NAME}: Running"):
            with fake_k8s.held():  # the client's new watch comes after all three
                fake_k8s.drop_watches()
                operator.finish()
                fake_k8s.compact()  # the events since the client's version are gone: 410

    play(story)
    outcome = run(fake_k8s, echo, poll_s=0.5)

    assert condition_is_true(outcome.obj, "Succeeded")
    assert job_requests(fake_k8s).count("LIST") == 2  # the first, and after 410 Expired
    assert fake_k8s.forbidden == []


def test_transient_api_errors_are_retried(
    fake_k8s: FakeK8s, operator: Operator, play: Callable[..., None]
) -> None:
    fake_k8s.fail("POST", "/pytorchjobs", 503)
    fake_k8s.fail("GET", "/pytorchjobs", 429, times=2)  # the list, then its retry
    fake_k8s.fail("GET", "/pods", 500, times=2)

    def story() -> None:
        operator.created()
        operator.start()
        operator.log("ok\n")
        operator.finish()

    play(story)
    outcome = run(fake_k8s, Echo())

    assert outcome.logs == "ok\n"
    assert job_requests(fake_k8s)[:4] == ["POST", "POST", "LIST", "LIST"]


def test_the_last_look_at_a_log_no_follower_read_retries_a_transient_error(
    fake_k8s: FakeK8s,
) -> None:
    """The job ended before the pod discovery got past the API server's errors (CI saw
    test_transient_api_errors_are_retried return no log this way): the one read at the end
    retries a 500 instead of returning nothing."""
    fake_k8s.add_pod(
        NS,
        MASTER,
        {"training.kubeflow.org/job-name": NAME, "training.kubeflow.org/replica-type": "master"},
        log="ok\n",
        spec={"containers": [{"name": CONTAINER, "image": "img"}]},
    )
    fake_k8s.fail("GET", "/pods", 500, times=2)
    echo = Echo()
    logs = PodLogs(
        KubeClient(fake_k8s.api_client(), POLL_S),
        NS,
        master_selector(NAME),
        CONTAINER,
        echo,
        PYTORCHJOB.kind,
        None,
    )

    assert logs.close(2.0) == "ok\n"  # never started: no follower, only the last read
    assert echo.lines == [f"[{MASTER}] ok"]
    assert logs.error("ok\n") is None


# ---------------------------------------------------------------------- ownership


def test_the_step_pod_owns_the_job_and_its_deletion_takes_the_job(
    fake_k8s: FakeK8s,
    operator: Operator,
    play: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    step = fake_k8s.add_pod(NS, "run-1-train-step", {}, phase="Running")
    monkeypatch.setenv("KUBELLM_POD_NAME", "run-1-train-step")
    monkeypatch.setenv("KUBELLM_POD_UID", step["metadata"]["uid"])
    monkeypatch.setenv("KUBELLM_POD_NAMESPACE", NS)
    echo = Echo()

    def story() -> None:
        operator.created()
        operator.start()
        if echo.wait_for(f"pytorchjob/{NAME}: Running"):
            fake_k8s.delete_object("pods", "run-1-train-step")  # the run is deleted

    play(story)
    with pytest.raises(JobFailed, match="deleted while waited on"):
        run(fake_k8s, echo)

    (sent,) = fake_k8s.created("pytorchjobs")
    assert sent["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "run-1-train-step",
            "uid": step["metadata"]["uid"],
            "controller": False,
            "blockOwnerDeletion": False,
        }
    ]
    assert sent["metadata"]["labels"] == manifest()["metadata"]["labels"]
    canonical = json.dumps(manifest()["spec"], sort_keys=True, separators=(",", ":"))
    assert sent["metadata"]["annotations"] == {
        SPEC_HASH_ANNOTATION: hashlib.sha256(canonical.encode()).hexdigest()
    }
    assert fake_k8s.get_object("pytorchjobs", NAME) is None
    assert fake_k8s.get_object("pods", MASTER) is None
    assert fake_k8s.forbidden == []


# ---------------------------------------------------------------------- on the simulated cluster
# The same lifecycle against the simulated Training Operator and kubelet: the master pod is
# a real process whose output is its log.


# `sim`: tests/k8s/conftest.py (the repo's Role; no errors, nothing forbidden)


def sim_job(name: str, code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A PyTorchJob whose master runs `python -c code` (valid against the CRD)."""
    container = {
        "name": CONTAINER,
        "image": "img",
        "command": ["python", "-c", textwrap.dedent(code)],
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "kubellm"}},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "restartPolicy": "ExitCode",
                    "template": {"spec": {"containers": [container]}},
                }
            },
            "runPolicy": {"backoffLimit": 2},
        },
    }


def sim_run(
    sim: SimCluster, body: dict[str, Any], echo: Callable[[str], None], timeout_s: float = 20
) -> RunOutcome:
    name = body["metadata"]["name"]
    return KubeClient(sim.api_client(), POLL_S).run(
        PYTORCHJOB,
        NS,
        body,
        timeout_s=timeout_s,
        done=succeeded,
        follow_logs=master_selector(name),
        log_container=CONTAINER,
        echo=echo,
    )


LIVE = """
    import os, pathlib, sys, time
    print("step=1 loss=2.5", flush=True)
    shown = pathlib.Path(os.environ["SHOWN"])
    deadline = time.time() + 10
    while not shown.exists():  # until the step has printed the line above
        if time.time() > deadline:
            sys.exit("the step never showed my first line")
        time.sleep(0.02)
    print("step=2 loss=2.0", flush=True)
    print("eval_loss=1.75", flush=True)
"""


def test_sim_a_training_process_is_echoed_live(sim: SimCluster, tmp_path: Path) -> None:
    shown = tmp_path / "shown"
    lines = Echo()

    def echo(line: str) -> None:
        lines(line)
        if line == "[live-master-0] step=1 loss=2.5":
            shown.touch()  # the process goes on only once its first line is in our stdout

    outcome = sim_run(sim, sim_job("live", LIVE, {"SHOWN": str(shown)}), echo)

    assert outcome.logs == "step=1 loss=2.5\nstep=2 loss=2.0\neval_loss=1.75\n"
    assert parse_metrics(outcome.logs)["eval_loss"] == 1.75
    assert lines.index("step=1 loss=2.5") < lines.index("pytorchjob/live: Succeeded")


CRASH = """
    for i in range(25):
        print(f"line {i:02d}", flush=True)
    raise RuntimeError("CUDA out of memory")
"""


def test_sim_a_crash_fails_with_the_reason_and_the_traceback(sim: SimCluster) -> None:
    with pytest.raises(JobFailed) as info:
        sim_run(sim, sim_job("crash", CRASH), Echo())

    msg = str(info.value)
    assert 'PyTorchJobFailed: job "crash" is failing because "Master" replica(s) failed.' in msg
    assert "--- last lines of crash-master-0 ---" in msg
    assert msg.endswith("RuntimeError: CUDA out of memory")
    assert "line 24" in msg and "line 00" not in msg


RETRY = """
    import os, pathlib, sys, time
    count = pathlib.Path(os.environ["COUNT"])
    attempt = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(attempt))
    print(f"attempt {attempt}", flush=True)
    shown = pathlib.Path(os.environ["SHOWN"])
    deadline = time.time() + 10
    while attempt == 1 and not shown.exists() and time.time() < deadline:
        time.sleep(0.02)  # so the step has seen this pod before it is replaced
    sys.exit(137 if attempt == 1 else 0)  # 128+: retryable, the operator makes a new pod
"""


def test_sim_a_retried_pod_is_followed_under_its_old_name(sim: SimCluster, tmp_path: Path) -> None:
    shown = tmp_path / "shown"
    lines = Echo()

    def echo(line: str) -> None:
        lines(line)
        if line == "[retry-master-0] attempt 1":
            shown.touch()

    env = {"COUNT": str(tmp_path / "count"), "SHOWN": str(shown)}
    outcome = sim_run(sim, sim_job("retry", RETRY, env), echo)

    first = lines.index("[retry-master-0] attempt 1")
    assert 0 <= first < lines.index("[retry-master-0] attempt 2")
    # Both pods' logs, one after the other. (The sim keeps a pod's log by name, so the new
    # pod's log repeats the old one's line, which a kubelet would not: hence no equality.)
    assert outcome.logs.startswith("attempt 1\n") and outcome.logs.endswith("attempt 2\n")


SLEEPER = """
    import os, pathlib, time
    pathlib.Path(os.environ["PID"]).write_text(str(os.getpid()))
    print("alive", flush=True)
    time.sleep(60)
"""


def test_sim_a_stopped_step_leaves_no_process_behind(sim: SimCluster, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    lines = Echo()

    def stop_when_alive() -> None:
        if lines.wait_for("[sleeper-master-0] alive", timeout=10):
            os.kill(os.getpid(), signal.SIGTERM)

    stray: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stray.append(signum))
    try:
        killer = threading.Thread(target=stop_when_alive, daemon=True)
        killer.start()
        with pytest.raises(JobStopped):
            sim_run(sim, sim_job("sleeper", SLEEPER, {"PID": str(pid_file)}), lines)
        killer.join(5)
    finally:
        signal.signal(signal.SIGTERM, previous)

    assert stray == []
    assert sim.fake.get_object("pytorchjobs", "sleeper") is None
    assert sim.fake.get_object("pods", "sleeper-master-0") is None
    pid = int(pid_file.read_text())
    until(lambda: not _alive(pid), "the master's process to end", timeout=10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is gone too
            return f.read().split(") ")[-1][:1] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # it ended and was reaped in between
        return False


# ---------------------------------------------------------------------- retries and queues
# PyTorchJobTrainer.run on the simulated cluster, its manifest as built, but the container's
# command swapped for a quick one (the real agent takes seconds to start under torchrun).


def swap_command(
    monkeypatch: pytest.MonkeyPatch, code: str, run_policy: dict[str, Any] | None = None
) -> None:
    """PyTorchJobTrainer's manifests run `python -c code`, with `run_policy` added."""
    real = pytorchjob.pytorchjob_manifest

    def manifest(job: TrainJob, cluster: ClusterSettings | None = None) -> dict[str, Any]:
        body = real(job, cluster)
        for spec in body["spec"]["pytorchReplicaSpecs"].values():
            (container,) = spec["template"]["spec"]["containers"]
            container["command"] = ["python", "-c", textwrap.dedent(code)]
            container.pop("args", None)
        body["spec"]["runPolicy"].update(run_policy or {})
        return body

    monkeypatch.setattr(pytorchjob, "pytorchjob_manifest", manifest)


def test_sim_a_retryable_exit_loops_past_the_backoff_limit_until_max_restarts(
    sim: SimCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator (release-1.9) recreates a master that exits 143 past the job's
    backoffLimit (3); the step deletes the job after max_restarts (4), saying why. Each
    attempt lives a moment after its line, as a trainer does before it fails: a pod that
    ends and is replaced within milliseconds (the sim's operator, unlike a cluster's) can
    be gone before its log is read, and then there is no tail to quote."""
    swap_command(
        monkeypatch,
        "import time; print('attempt', flush=True); time.sleep(0.3); raise SystemExit(143)",
    )
    trainer = PyTorchJobTrainer(
        sim.api_client(), cluster=ClusterSettings(max_restarts=4), poll_interval_s=POLL_S
    )
    with pytest.raises(JobFailed) as info:
        trainer.run(TrainJob(name="flaky", train_args=[], image="img", timeout_s=30.0))

    msg = str(info.value)
    assert msg.startswith(
        "pytorchjob/flaky in default: pod flaky-master-0 failed 5 times with retryable exits, "
        "more than job_max_restarts=4 allows (the last time: exit code 143)"
    ), msg
    assert "; it has been deleted\n--- last lines of flaky-master-0 ---\nattempt" in msg
    runs = [e for e in sim.fake.history("pods") if e.type == "ADDED"]
    assert len(runs) >= 5 > 3 + 1  # past backoffLimit: the operator never stopped it
    assert sim.fake.get_object("pytorchjobs", "flaky") is None


def test_sim_a_suspended_jobs_timeout_does_not_run_while_it_waits(
    sim: SimCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job created suspended (as Kueue's webhook creates it) has no pods and keeps its
    whole timeout until it is admitted; then it runs and succeeds."""
    swap_command(monkeypatch, "print('eval_loss=1.5', flush=True)", {"suspend": True})
    admitted: list[int] = []  # the resourceVersion at admission

    def admit() -> None:
        sim.wait_for(lambda: sim.condition("pytorchjobs", "queued", "Suspended"), 10, "Suspended")
        time.sleep(1.5)  # longer than the timeout
        assert sim.fake.list_objects("pods") == []
        obj = sim.fake.get_object("pytorchjobs", "queued")
        obj["spec"]["runPolicy"]["suspend"] = False  # what Kueue does on admission
        admitted.append(sim.fake.resource_version)
        sim.fake.put_object("pytorchjobs", obj)

    admitter = threading.Thread(target=admit, daemon=True)
    admitter.start()
    result = PyTorchJobTrainer(sim.api_client(), poll_interval_s=POLL_S).run(
        TrainJob(name="queued", train_args=[], image="img", timeout_s=1.0)
    )
    admitter.join(5)

    assert admitted and result.metrics == {"eval_loss": 1.5}
    out = capsys.readouterr().out
    assert "pytorchjob/queued: waiting in a queue (suspended); the 1s timeout starts" in out
    assert "pytorchjob/queued: admitted after" in out
    pods = [e.rv for e in sim.fake.history("pods") if e.type == "ADDED"]
    assert pods and min(pods) > admitted[0]  # no pod before the admission


def test_a_job_that_waits_in_the_queue_too_long_is_deleted(fake_k8s: FakeK8s) -> None:
    body = manifest()
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    body["spec"]["runPolicy"]["suspend"] = True  # as Kueue's webhook leaves it, for ever
    with pytest.raises(JobTimeout) as info:
        run(fake_k8s, Echo(), timeout_s=10.0, body=body, queued=pytorchjob_queued,
            queue_timeout_s=0.3)  # fmt: skip
    assert str(info.value) == (
        "pytorchjob/llm-train in default was not admitted within 0.3s (waiting in a queue: "
        "suspended, queue team-a; last state: Pending); it has been deleted"
    )
    assert fake_k8s.get_object("pytorchjobs", NAME) is None
