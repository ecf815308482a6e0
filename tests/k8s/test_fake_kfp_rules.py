"""Rules of the fake KFP API server that no other test pins (rows of tests/fakes/UPSTREAM.md)."""

from __future__ import annotations

from typing import Any

import requests

from fakes.fake_kfp import API, FakeKfp


def _post(fake: FakeKfp, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{fake.url}{API}{path}", json=body, timeout=10)


def test_pipeline_names_are_unique_per_namespace() -> None:
    # model/pipeline.go: uniqueIndex namespace_name
    with FakeKfp() as fake:
        assert _post(fake, "/pipelines", {"name": "p", "namespace": "a"}).ok
        assert _post(fake, "/pipelines", {"name": "p", "namespace": "b"}).ok
        again = _post(fake, "/pipelines", {"name": "p", "namespace": "a"})
        assert again.status_code == 409 and again.json()["code"] == 6


def test_multi_user_mode_is_announced_and_needs_a_namespace() -> None:
    with FakeKfp(multi_user=True) as fake:
        health = requests.get(f"{fake.url}{API}/healthz", timeout=10).json()
        assert health["multi_user"] is True
        listed = requests.get(f"{fake.url}{API}/experiments", timeout=10)
        assert listed.status_code == 400 and "namespace" in listed.json()["message"]
        ok = requests.get(f"{fake.url}{API}/experiments", params={"namespace": "t"}, timeout=10)
        assert ok.ok
    with FakeKfp() as fake:
        assert requests.get(f"{fake.url}{API}/healthz", timeout=10).json()["multi_user"] is False


def test_experiment_names_are_unique_per_namespace() -> None:
    # model/experiment.go: uniqueIndex idx_name_namespace; experiment_store.go's 409
    with FakeKfp() as fake:
        assert _post(fake, "/experiments", {"display_name": "e", "namespace": "a"}).ok
        assert _post(fake, "/experiments", {"display_name": "e", "namespace": "b"}).ok
        again = _post(fake, "/experiments", {"display_name": "e", "namespace": "a"})
        assert again.status_code == 409 and again.json()["code"] == 6
        assert again.json()["message"] == (
            "Failed to create a new experiment. The name e already exists. Please specify a "
            "new name"
        )
