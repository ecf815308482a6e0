"""Fixtures for the Kubernetes launchers: a fake API server that validates against real schemas.

The schemas are data from the upstream projects (see shared/crds/README.md); a clone without
them skips these tests and says where to get them, rather than testing against nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fakes.fake_k8s import FakeK8s
from fakes.k8s_schemas import crds_dir, missing_files, skip_reason

# Polls in these tests are fast; a real cluster uses seconds.
POLL_S = 0.05


@pytest.fixture
def fake_k8s() -> Iterator[FakeK8s]:
    directory = crds_dir()
    if missing_files(directory):
        pytest.skip(skip_reason(directory))
    with FakeK8s(directory) as fake:
        yield fake
