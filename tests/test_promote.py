"""`kubellm promote NAME@VERSION`: the champion alias moves to a registered version, which is
served from the registry by the deploy stage's code path: a real KServe ModelServer on
loopback (local backend, MLflow on sqlite), and an InferenceService on the simulated cluster
(fake API server with the KServe controller, the workspace PVC a local directory)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes.config import kube_config
from mlflow.tracking import MlflowClient

from fakes.sim_cluster import WORKSPACE_PVC, SimCluster
from kubellm.backends.local.model_server import LocalModelServer
from kubellm.cli import main
from kubellm.commands.promote import TAG_PROMOTED, promote
from kubellm.config import ConfigError, pipeline_config
from kubellm.serve.client import Endpoint, ask, is_ready
from kubellm.serve.generate import complete, load_model
from kubellm.stages.deploy import TAG_SERVING_URI
from kubellm.tracking.registry import PredictDefaults, log_transformers_model, register_version
from serve.tiny_model import build_tiny_model

NAME = "tiny-promote"
PROMPTS = ["12+7=", "3+4=", "100+1="]
NEW_TOKENS = 6


@dataclass
class Registry:
    runs: Path
    uri: str
    client: MlflowClient
    answers: dict[str, list[str]]  # version -> what its model answers PROMPTS


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """Versions 1 and 2 (different weights, gate promote), 3 (gate reject); champion 2."""
    root = tmp_path_factory.mktemp("promote")
    runs = root / "runs"
    uri = f"sqlite:///{runs / 'mlflow.db'}"
    runs.mkdir()
    client = MlflowClient(uri)
    exp = client.create_experiment("promote", (runs / "mlartifacts").as_uri())
    answers = {}
    gates = {"1": "promote", "2": "promote", "3": "reject"}
    for seed, (version, gate) in enumerate(gates.items()):
        model_dir = build_tiny_model(root / f"model-{version}", seed=seed)
        model, tokenizer = load_model(model_dir)
        answers[version] = complete(model, tokenizer, PROMPTS, NEW_TOKENS)
        run_id = client.create_run(exp).info.run_id
        defaults = PredictDefaults("1+1=", NEW_TOKENS)
        logged = log_transformers_model(client, exp, run_id, model_dir, defaults, "# tiny\n")
        tags = {"kubellm.gate": gate, "kubellm.gate_reason": f"seed {seed} decided {gate}"}
        mv = register_version(client, NAME, logged, run_id, tags)
        assert str(mv.version) == version
    assert answers["1"] != answers["2"], "the versions must answer differently"
    client.set_registered_model_alias(NAME, "champion", "2")
    yield Registry(runs, uri, client, answers)
    LocalModelServer(runs / "servers").delete(NAME, "")


def champion(reg: Registry) -> str:
    return str(reg.client.get_model_version_by_alias(NAME, "champion").version)


def cli(reg: Registry, ref: str, *extra: str) -> list[str]:
    args = ["--tracking-uri", reg.uri, "--set", f"runs_dir={reg.runs}", "--local", *extra]
    return ["promote", ref, *args]


def test_rollback_moves_the_alias_and_serves_the_older_version(
    registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    assert champion(registry) == "2"
    assert main(cli(registry, f"{NAME}@1")) == 0
    out = capsys.readouterr().out.strip().splitlines()
    endpoint = out[-1]
    assert endpoint.startswith("http://127.0.0.1:")
    assert f"{NAME} v1 is champion (was v2)" in out[-2]
    assert champion(registry) == "1"
    served = registry.runs / "work" / f"promote-{NAME}" / "serve" / "v1"
    assert (served / "model.safetensors").is_file() and (served / "tokenizer.json").is_file()
    mv = registry.client.get_model_version(NAME, "1")
    assert mv.tags[TAG_SERVING_URI] == str(served)
    assert "by kubellm promote (champion was v2)" in mv.tags[TAG_PROMOTED]
    assert ask(Endpoint(NAME, endpoint), PROMPTS, NEW_TOKENS) == registry.answers["1"]

    # and forward again: the same deployment now serves version 2
    assert main(cli(registry, f"{NAME}@2")) == 0
    again = capsys.readouterr().out.strip().splitlines()[-1]
    assert champion(registry) == "2"
    assert ask(Endpoint(NAME, again), PROMPTS, NEW_TOKENS) == registry.answers["2"]
    assert again == endpoint or not is_ready(Endpoint(NAME, endpoint)), "v1 still served"


@dataclass(frozen=True)
class Refused:
    ref: str
    message: str


REFUSED = [
    Refused(f"{NAME}@3", "version 3 was rejected by the gate (seed 2 decided reject); "),
    Refused(f"{NAME}@9", f"registered model '{NAME}' has no version '9' (versions: 1, 2, 3)"),
    Refused(f"{NAME}@canary", f"registered model '{NAME}' has no alias 'canary'"),
    Refused("nope@1", "no registered model 'nope' in sqlite:"),
    Refused(NAME, "expected NAME@VERSION"),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.ref)
def test_refused_with_a_clear_error_and_the_champion_kept(
    case: Refused, registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    before = champion(registry)
    assert main(cli(registry, case.ref)) == 2
    err = capsys.readouterr().err
    assert case.message in err
    assert champion(registry) == before


def test_force_promotes_a_rejected_version(registry: Registry) -> None:
    cfg = pipeline_config(
        {"platform": "local", "runs_dir": str(registry.runs), "mlflow_tracking_uri": registry.uri}
    )
    with pytest.raises(ConfigError, match="--force"):
        promote(cfg, f"{NAME}@3")
    done = promote(cfg, f"{NAME}@3", force=True)
    try:
        assert champion(registry) == "3" and done.previous in ("1", "2")
        assert ask(Endpoint(NAME, done.endpoint), PROMPTS, NEW_TOKENS) == registry.answers["3"]
        assert registry.client.get_model_version(NAME, "3").tags[TAG_PROMOTED].endswith("--force")
    finally:
        promote(cfg, f"{NAME}@{done.previous}")
    assert champion(registry) == done.previous


def test_on_the_simulated_cluster_an_inferenceservice_serves_it(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """platform=kubernetes: the version is copied onto the workspace PVC and served by an
    InferenceService (KServe's Hugging Face runtime) whose storage is pvc://; promoting
    another brings it up beside the first, then moves all traffic to it."""
    with SimCluster(tmp_path / "cluster") as sim:
        for key, value in sim.env("kubellm").items():
            monkeypatch.setenv(key, value)
        # the kubernetes client read $KUBECONFIG when it was imported
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", os.environ["KUBECONFIG"])
        cfg = pipeline_config(
            {
                "platform": "kubernetes",
                "namespace": "kubellm",
                "runs_dir": str(registry.runs),
                "mlflow_tracking_uri": registry.uri,
                "job_timeout_minutes": 2,
            }
        )
        first = promote(cfg, f"{NAME}@1")
        assert first.model_uri == f"pvc://{WORKSPACE_PVC}/promote-{NAME}/serve/v1"
        isvc = sim.fake.get_object("inferenceservices", NAME, "kubellm")
        model = isvc["spec"]["predictor"]["model"]  # KServe's Hugging Face runtime
        assert model["modelFormat"]["name"] == "huggingface"
        assert model["storageUri"] == first.model_uri
        assert "kubellm/run-tag" not in (isvc["metadata"].get("annotations") or {})
        assert ask(Endpoint(NAME, first.endpoint), PROMPTS, NEW_TOKENS) == registry.answers["1"]
        assert champion(registry) == "1"

        second = promote(cfg, f"{NAME}@2")
        assert second.model_uri.endswith("/serve/v2")
        assert ask(Endpoint(NAME, second.endpoint), PROMPTS, NEW_TOKENS) == registry.answers["2"]
        assert champion(registry) == "2"
        # v2 came up as a canary beside v1, then took all traffic
        status = sim.fake.get_object("inferenceservices", NAME, "kubellm")["status"]
        traffic = status["components"]["predictor"]["traffic"]
        assert [(t["revisionName"], t["percent"]) for t in traffic if t["percent"]] == [
            (status["components"]["predictor"]["latestRolledoutRevision"], 100)
        ]
        assert status["components"]["predictor"]["latestRolledoutRevision"].endswith("-00002")
        assert sim.errors == []


def test_from_a_laptop_a_cluster_version_is_served_from_its_deploy_copy(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No workspace PVC mounted where promote runs: the copy the deploy step left on the PVC
    (the version's serving URI tag), or a clear error; an object store needs neither."""
    from types import SimpleNamespace

    from kubellm.backends.kubernetes.workspace import PvcWorkspace
    from kubellm.commands.promote import _model_uri

    monkeypatch.setenv("KUBELLM_WORKSPACE_MOUNT", str(tmp_path / "not-mounted"))
    ws = PvcWorkspace(WORKSPACE_PVC, "promote-x")
    copied = f"pvc://{WORKSPACE_PVC}/run-1/serve/v4"
    kept = SimpleNamespace(name=NAME, version="4", source="mlflow-artifacts:/1/m", tags={})
    kept.tags[TAG_SERVING_URI] = copied
    assert _model_uri(ws, registry.client, kept) == copied
    s3 = SimpleNamespace(name=NAME, version="5", source="s3://bucket/1/models/m/artifacts", tags={})
    assert _model_uri(ws, registry.client, s3) == f"{s3.source}/model"  # a complete HF dir
    never = SimpleNamespace(name=NAME, version="6", source="mlflow-artifacts:/1/n", tags={})
    with pytest.raises(ConfigError, match="no deploy step copied it onto the workspace PVC"):
        _model_uri(ws, registry.client, never)
    assert not (tmp_path / "not-mounted").exists()
