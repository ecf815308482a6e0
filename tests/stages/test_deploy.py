"""stages.deploy: the registered version, fetched from the registry (not the run's model
artifact), served by the loopback ModelServer, answering readiness."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from kubellm.backends.kubernetes.workspace import PvcWorkspace
from kubellm.config import ConfigError
from kubellm.serve.client import Endpoint, is_ready
from kubellm.stages import deploy
from kubellm.stages.context import StageContext
from kubellm.tracking.registry import storage_uri
from stages.conftest import RUN, Chain, side_context


def test_endpoint_is_ready_on_loopback(chain: Chain) -> None:
    result = chain.results["deploy"]
    assert result.endpoint.startswith("http://127.0.0.1:")
    assert is_ready(Endpoint("tiny-stage", result.endpoint))
    body = {"instances": [{"prompt": "1+1=", "max_new_tokens": 2}]}
    r = requests.post(f"{result.endpoint}/v1/models/tiny-stage:predict", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1
    assert result.endpoint in result.headline


def test_serves_the_registry_copy_from_the_run_workspace(chain: Chain, ctx: StageContext) -> None:
    result = chain.results["deploy"]
    version = chain.results["register"].version
    served = Path(result.model_uri)
    assert served == Path(ctx.cfg.runs_dir) / "work" / RUN / "serve" / f"v{version}"
    assert served != chain.artifact("model")
    mv = ctx.tracker.client.get_model_version("tiny-stage", version)
    stored = storage_uri(ctx.tracker.client, mv)
    registered = Path(stored.removeprefix("file://")) / "model" / "model.safetensors"
    assert (served / "model.safetensors").read_bytes() == registered.read_bytes()
    assert (served / "tokenizer.json").is_file()
    assert mv.tags[deploy.TAG_SERVING_URI] == result.model_uri
    run = ctx.stage_runs()["deploy"]
    assert (
        run.data.params["registry_source"]
        == mv.source
        == f"models:/{mv.tags['kubellm.logged_model']}"
    )
    assert run.data.params["registry_storage"] == stored
    assert run.data.params["model_uri"] == result.model_uri


def test_a_version_missing_from_the_registry_fails_the_stage(ctx: StageContext) -> None:
    side = side_context(ctx, "deploy-missing")
    with pytest.raises(ConfigError, match=r"'tiny-stage' has no version '99' \(versions: 1"):
        deploy.run(side, "/nowhere", "99")
    assert side.stage_runs()["deploy"].info.status == "FAILED"


def test_on_a_cluster_an_object_store_version_goes_to_kserve_as_is(
    ctx: StageContext, tmp_path: Path
) -> None:
    ws = PvcWorkspace("kubellm-workspace", RUN, mount=str(tmp_path))
    s3 = SimpleNamespace(source="s3://models/1/models/m-1/artifacts", version="3", name="x")
    # its model/ folder: weights and tokenizer, the directory KServe's HF runtime loads
    assert deploy.registry_model_uri(ws, ctx.tracker.client, s3) == f"{s3.source}/model"
    assert not (tmp_path / RUN / "serve").exists(), "nothing downloaded for KServe to fetch"


def test_on_a_cluster_another_store_is_copied_onto_the_pvc(
    chain: Chain, ctx: StageContext, tmp_path: Path
) -> None:
    ws = PvcWorkspace("kubellm-workspace", RUN, mount=str(tmp_path))
    mv = ctx.tracker.client.get_model_version("tiny-stage", chain.results["register"].version)
    uri = deploy.registry_model_uri(ws, ctx.tracker.client, mv)
    assert uri == f"pvc://kubellm-workspace/{RUN}/serve/v{mv.version}"
    assert (tmp_path / RUN / "serve" / f"v{mv.version}" / "config.json").is_file()
    assert (tmp_path / RUN / "serve" / f"v{mv.version}" / "tokenizer.json").is_file()
