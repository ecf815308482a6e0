"""Fixtures for the Kubernetes launchers: a fake API server that validates against real schemas.

The schemas are data from the upstream projects, vendored in tests/fixtures/crds (its README
names each upstream repository and commit). A missing schema fails these tests, naming the
file; it never skips them, since a fake that validates against nothing proves nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fakes.fake_k8s import FakeK8s
from fakes.k8s_schemas import crds_dir, missing_files, missing_reason
from fakes.sim_cluster import SimCluster

# Polls in these tests are fast; a real cluster uses seconds.
POLL_S = 0.05

# PyTorchJob default/llm-train's statuses as the Training Operator writes them.
CREATED = {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"}
RUNNING = {"conditions": [CREATED, {"type": "Running", "status": "True"}]}
SUCCEEDED = {
    "conditions": [
        CREATED,
        {"type": "Running", "status": "False"},
        {
            "type": "Succeeded",
            "status": "True",
            "reason": "PyTorchJobSucceeded",
            "message": "PyTorchJob default/llm-train successfully completed.",
        },
    ],
    "replicaStatuses": {"Master": {"succeeded": 1}},
}
FAILED = {
    "conditions": [
        CREATED,
        {"type": "Running", "status": "False"},
        {
            "type": "Failed",
            "status": "True",
            "reason": "PyTorchJobFailed",
            "message": "PyTorchJob default/llm-train is failed because 1 Master replica(s) failed.",
        },
    ],
    "replicaStatuses": {"Master": {"failed": 1}},
}


@pytest.fixture
def fake_k8s() -> Iterator[FakeK8s]:
    directory = crds_dir()
    if missing_files(directory):
        pytest.fail(missing_reason(directory), pytrace=False)
    with FakeK8s(directory) as fake:
        yield fake


@pytest.fixture
def play() -> Iterator[Callable[[Callable[[], None]], None]]:
    """Run the cluster's side of a test in a thread; its errors fail the test."""
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    def start(story: Callable[[], None]) -> None:
        def target() -> None:
            try:
                story()
            except BaseException as e:
                errors.append(e)

        threads.append(threading.Thread(target=target, daemon=True))
        threads[-1].start()

    yield start
    for thread in threads:
        thread.join(10)
    if errors:
        raise errors[0]


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimCluster]:
    """A simulated cluster under the repo's Role (a module may define its own `sim`); after
    the test, no controller error, no request the API server refused as invalid, and none
    the Role did not allow."""
    with SimCluster(tmp_path) as cluster:
        yield cluster
        assert cluster.errors == []
        assert cluster.fake.errors == [] and cluster.fake.forbidden == []
