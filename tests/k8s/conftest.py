"""Fixtures for the Kubernetes launchers: a fake API server that validates against real schemas.

The schemas are data from the upstream projects, vendored in tests/fixtures/crds (its README
names each upstream repository and commit). A missing schema fails these tests, naming the
file; it never skips them, since a fake that validates against nothing proves nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fakes.fake_k8s import FakeK8s
from fakes.k8s_schemas import crds_dir, missing_files, missing_reason

# Polls in these tests are fast; a real cluster uses seconds.
POLL_S = 0.05


@pytest.fixture
def fake_k8s() -> Iterator[FakeK8s]:
    directory = crds_dir()
    if missing_files(directory):
        pytest.fail(missing_reason(directory), pytrace=False)
    with FakeK8s(directory) as fake:
        yield fake
