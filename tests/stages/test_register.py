"""stages.register: the model logged once as an MLflow transformers model, registered as a
version with lineage tags, alias challenger; it loads back from the registry and generates."""

from __future__ import annotations

import importlib.metadata
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubellm import __version__
from kubellm.serve.generate import complete, load_model
from kubellm.stages import register
from kubellm.stages.context import StageContext
from kubellm.tracking.registry import (
    TAG_LOGGED_MODEL,
    TAG_MODEL_VERSIONS,
    download_hf_dir,
    storage_uri,
)
from stages.conftest import RUN, Chain, side_context


def test_version_with_lineage(chain: Chain, ctx: StageContext) -> None:
    result = chain.results["register"]
    assert result.version == "1"
    client = ctx.tracker.client
    mv = client.get_model_version_by_alias("tiny-stage", "challenger")
    assert str(mv.version) == result.version
    runs = ctx.stage_runs()
    assert mv.tags["kubellm.data_fingerprint"] == chain.results["prepare_data"].data_fingerprint
    recipe = chain.results["prepare_data"].recipe_fingerprint
    assert mv.tags["kubellm.recipe_fingerprint"] == recipe and len(recipe) == 64
    assert runs["prepare_data"].data.tags["kubellm.recipe_fingerprint"] == recipe
    assert mv.tags["kubellm.gate"] == "promote" and mv.tags["kubellm.gate_reason"]
    assert mv.tags["kubellm.training_run"] == runs["train"].info.run_id
    assert mv.tags["kubellm.best_trial"] == chain.results["tune"].best_trial
    evaluation = ctx.tracker.client.get_run(mv.tags["kubellm.evaluation_run"])
    assert evaluation.data.tags["kubellm.stage"] == "evaluate"
    assert evaluation.data.tags["mlflow.parentRunId"] == ctx.parent_run_id
    assert mv.tags["kubellm.kfp_run_id"] == RUN
    assert mv.tags["kubellm.pipeline_run"] == ctx.parent_run_id
    assert mv.tags["kubellm.trainer_image"] == ctx.cfg.trainer_image
    assert mv.tags["kubellm.serving_image"] == ctx.cfg.serving_image
    assert mv.tags["kubellm.version"] == __version__
    assert "version 1" in result.headline


def test_logged_once_as_an_mlflow_model_of_the_register_run(
    chain: Chain, ctx: StageContext
) -> None:
    """One LoggedModel, output of the register stage's run; the version's files are its
    artifacts, which have the transformers and pyfunc flavors, a signature, an input
    example, safetensors weights, a tokenizer and pinned requirements."""
    client = ctx.tracker.client
    result = chain.results["register"]
    mv = client.get_model_version("tiny-stage", result.version)
    register_run = ctx.stage_runs()["register"]
    logged = client.get_logged_model(result.model_id)
    assert mv.tags[TAG_LOGGED_MODEL] == result.model_id == logged.model_id
    assert logged.source_run_id == mv.run_id == register_run.info.run_id
    assert str(logged.status) in ("READY", "LoggedModelStatus.READY")
    assert result.storage == logged.artifact_location
    outputs = [o.model_id for o in register_run.outputs.model_outputs]
    assert outputs == [result.model_id]
    models = client.search_logged_models([ctx.tracker.experiment_id])
    assert [m.model_id for m in models if m.source_run_id == register_run.info.run_id] == [
        result.model_id
    ]

    root = Path(client.download_artifacts(register_run.info.run_id, "", str(chain.root / "x")))
    assert not (root / "model").exists(), "the model is logged once, not also as run artifacts"
    art = Path(result.storage.removeprefix("file://"))
    mlmodel = yaml.safe_load((art / "MLmodel").read_text())
    assert mlmodel["model_id"] == result.model_id and mlmodel["run_id"] == mv.run_id
    flavor = mlmodel["flavors"]["transformers"]
    assert flavor["task"] == "text-generation"
    assert flavor["components"] == ["tokenizer"]
    assert mlmodel["flavors"]["python_function"]["loader_module"] == "mlflow.transformers"
    assert json.loads(mlmodel["signature"]["inputs"]) == [{"type": "string", "required": True}]
    assert (art / mlmodel["saved_input_example_info"]["artifact_path"]).is_file()
    assert (art / "model" / "model.safetensors").is_file()
    assert not list(art.rglob("*.bin")), "weights are safetensors only"
    assert (art / "components" / "tokenizer" / "tokenizer.json").is_file()
    # model/ alone is a Hugging Face directory: what KServe's HF runtime gets as storageUri
    tokenizer_files = {p.name for p in (art / "components" / "tokenizer").iterdir()}
    assert tokenizer_files <= {p.name for p in (art / "model").iterdir()}
    requirements = (art / "requirements.txt").read_text().split()
    version = importlib.metadata.version("transformers")
    assert f"transformers=={version}" in requirements
    assert any(r.startswith("torch==") for r in requirements)
    assert not (art / "LICENSE.txt").exists(), "no pointer to huggingface.co/<local path>"
    card = (art / "model_card.md").read_text()
    assert f"pipeline run `{RUN}`" in card


def test_the_version_is_registered_from_the_logged_models_uri(
    chain: Chain, ctx: StageContext
) -> None:
    """MLflow 3's link from a version to its model page: source `models:/<model_id>`, as
    mlflow.register_model makes it, and the LoggedModel lists the version. The registry
    keeps the LoggedModel's artifact location as the version's storage (what downloads and
    KServe read). MLflow's open-source stores keep no model_id column, so the version's
    model id is the one its source names."""
    from mlflow.store.artifact.utils.models import _parse_model_id_if_present

    client = ctx.tracker.client
    result = chain.results["register"]
    mv = client.get_model_version("tiny-stage", result.version)
    assert mv.source == result.source == f"models:/{result.model_id}"
    assert _parse_model_id_if_present(mv.source) == result.model_id
    assert mv.model_id in (None, result.model_id)  # None: sqlite and the server store none
    logged = client.get_logged_model(result.model_id)
    stored = client.get_model_version_download_uri("tiny-stage", result.version)
    assert stored == result.storage == storage_uri(client, mv) == logged.artifact_location
    assert json.loads(logged.tags[TAG_MODEL_VERSIONS]) == [
        {"name": "tiny-stage", "version": result.version}
    ]
    assert f"models:/{result.model_id}" in result.report and stored in result.report


def test_the_logged_model_carries_the_evaluation_metrics_and_dataset(
    chain: Chain, ctx: StageContext
) -> None:
    """The LoggedModel's metrics are the evaluate run's own figures (not the champion's),
    each naming that run and the evaluation dataset (the held-out split); the evaluate run
    has the model as an input and keeps one point per metric."""
    client = ctx.tracker.client
    result = chain.results["register"]
    mv = client.get_model_version("tiny-stage", result.version)
    evaluation = client.get_run(mv.tags["kubellm.evaluation_run"])  # the chain's evaluate run
    [given] = [
        d
        for d in evaluation.inputs.dataset_inputs
        if {t.key: t.value for t in d.tags}["mlflow.data.context"] == "evaluation"
    ]
    logged = client.get_logged_model(result.model_id)
    on_model = {m.key: m for m in logged.metrics}
    measured = {k: v for k, v in evaluation.data.metrics.items() if not k.startswith("champion_")}
    assert {"eval_loss", "perplexity", "exact_match"} <= set(on_model)
    assert {k: m.value for k, m in on_model.items()} == pytest.approx(measured)
    for m in on_model.values():
        assert (m.dataset_name, m.dataset_digest) == (given.dataset.name, given.dataset.digest)
        assert m.run_id == evaluation.info.run_id and m.model_id == result.model_id
    assert [i.model_id for i in evaluation.inputs.model_inputs] == [result.model_id]
    assert len(client.get_metric_history(evaluation.info.run_id, "eval_loss")) == 1


@pytest.fixture(scope="module")
def registry_env(ctx: StageContext, monkeypatch_module: Any) -> str:
    """models:/ URIs resolve against the chain's store (the only global MLflow state)."""
    uri = ctx.cfg.mlflow_tracking_uri
    monkeypatch_module.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_mlflow_transformers_loads_the_registered_version_and_generates(
    chain: Chain, registry_env: str
) -> None:
    """The acceptance check: models:/NAME/VERSION loads with mlflow.transformers (a
    text-generation pipeline) and with pyfunc, and both generate what evaluate measured."""
    import mlflow.pyfunc
    import mlflow.transformers

    version = chain.results["register"].version
    expected = json.loads(chain.artifact("predictions.json").read_text())[:6]
    prompts = [e["prompt"] for e in expected]
    budget = int(expected[0]["max_new_tokens"])

    pipe = mlflow.transformers.load_model(f"models:/tiny-stage/{version}")
    assert type(pipe).__name__ == "TextGenerationPipeline"
    out = pipe(prompts[0], max_new_tokens=budget, do_sample=False, return_full_text=False)
    assert out[0]["generated_text"].strip() == expected[0]["prediction"]

    model = mlflow.pyfunc.load_model(f"models:/tiny-stage/{version}")
    answers = model.predict(prompts, params={"max_new_tokens": budget})
    assert [a.strip() for a in answers] == [e["prediction"] for e in expected]


def test_pyfunc_loads_the_champion_by_alias_and_predicts_with_the_datas_defaults(
    chain: Chain, registry_env: str, champion_v1: str
) -> None:
    """The acceptance check of issue 25: models:/NAME@champion loads with pyfunc and, with
    no params, answers as evaluate did: the default max_new_tokens is the budget evaluate
    gave this data's longest completion, and the input example is one of its prompts (in
    the signature, the model config and the MLmodel), not a fixed "12+7=" and 8 tokens."""
    import mlflow.pyfunc
    from mlflow.tracking import MlflowClient

    expected = json.loads(chain.artifact("predictions.json").read_text())[:6]
    budget = int(expected[0]["max_new_tokens"])
    model = mlflow.pyfunc.load_model("models:/tiny-stage@champion")
    assert model.metadata.model_id == chain.results["register"].model_id
    answers = model.predict([e["prompt"] for e in expected])
    assert [a.strip() for a in answers] == [e["prediction"] for e in expected]
    [param] = model.metadata.get_params_schema().params
    assert (param.name, param.default) == ("max_new_tokens", budget)
    assert model.model_config["max_new_tokens"] == budget
    art = Path(chain.results["register"].storage.removeprefix("file://"))
    assert model.metadata.load_input_example(str(art)) == expected[0]["prompt"]
    mv = MlflowClient().get_model_version_by_alias("tiny-stage", "champion")
    origin = model.metadata.metadata["kubellm.predict_defaults_from"]
    assert origin == f"evaluate run {mv.tags['kubellm.evaluation_run']}"


def test_predict_defaults_follow_the_evaluate_run_else_the_fallback() -> None:
    """What the register stage reads off the evaluate run: its first prompt and budget,
    bounded to 1..512; without an evaluate run (or its tags), the fallback."""
    from types import SimpleNamespace

    from kubellm.stages.evaluate import TAG_INPUT_EXAMPLE, TAG_MAX_NEW_TOKENS

    def run(**tags: str) -> Any:
        return SimpleNamespace(info=SimpleNamespace(run_id="e1"), data=SimpleNamespace(tags=tags))

    got = register.predict_defaults(
        run(**{TAG_INPUT_EXAMPLE: "Q: hi\nA:", TAG_MAX_NEW_TOKENS: "23"})
    )
    assert (got.input_example, got.max_new_tokens, got.origin) == (
        "Q: hi\nA:",
        23,
        "evaluate run e1",
    )
    assert got.model_config() == {
        "max_new_tokens": 23,
        "do_sample": False,
        "return_full_text": False,
    }
    huge = register.predict_defaults(run(**{TAG_INPUT_EXAMPLE: "x", TAG_MAX_NEW_TOKENS: "99999"}))
    assert huge.max_new_tokens == 512
    assert register.predict_defaults(None) == register.FALLBACK
    assert register.predict_defaults(run()) == register.FALLBACK
    assert register.FALLBACK.origin == "kubellm defaults (no evaluate run)"


def test_download_hf_dir_assembles_a_hugging_face_directory(
    chain: Chain, ctx: StageContext
) -> None:
    client = ctx.tracker.client
    mv = client.get_model_version("tiny-stage", chain.results["register"].version)
    dest = download_hf_dir(client, mv, chain.root / "hf-download")
    names = {p.name for p in dest.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "MLmodel" not in names
    trained = (chain.artifact("model") / "model.safetensors").read_bytes()
    assert (dest / "model.safetensors").read_bytes() == trained
    model, tokenizer = load_model(dest)
    expected = json.loads(chain.artifact("predictions.json").read_text())[:3]
    budget = int(expected[0]["max_new_tokens"])
    answers = complete(model, tokenizer, [e["prompt"] for e in expected], budget)
    assert answers == [e["prediction"] for e in expected]
    # the server also reads the MLflow layout itself (KServe copies it to /mnt/models as is)
    art = Path(storage_uri(client, mv).removeprefix("file://"))
    model, tokenizer = load_model(art)
    answer = complete(model, tokenizer, [expected[0]["prompt"]], budget)
    assert answer == [expected[0]["prediction"]]


def test_a_version_of_the_old_layout_downloads_as_it_is(
    chain: Chain, ctx: StageContext, tmp_path: Path
) -> None:
    """Versions registered before models were MLflow models: a plain Hugging Face source."""
    client = ctx.tracker.client
    run = client.create_run(ctx.tracker.experiment_id)
    client.log_artifacts(run.info.run_id, str(chain.artifact("model")), "model")
    client.create_registered_model("tiny-old-layout")
    mv = client.create_model_version(
        "tiny-old-layout", f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    )
    dest = download_hf_dir(client, mv, tmp_path / "old")
    assert (dest / "model.safetensors").read_bytes() == (
        chain.artifact("model") / "model.safetensors"
    ).read_bytes()
    assert (dest / "tokenizer.json").is_file()


def test_registering_reaches_no_hub_and_no_pip(
    chain: Chain, ctx: StageContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logging must work offline: any host name lookup but loopback's fails the test (the
    Hub client retries a failed lookup for about a minute), and no subprocess (pip's
    requirement inference) starts."""
    attempts: list[Any] = []
    loopback = ("127.0.0.1", "::1", "localhost")
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in loopback:
            attempts.append(host)
            raise socket.gaierror(f"test: no network ({host})")
        return real_getaddrinfo(host, *args, **kwargs)

    def no_subprocess(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args[0] if args else kwargs)
        raise AssertionError(f"a subprocess started: {args}")

    import subprocess

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    # a relative directory name that is also a valid Hub repo id ("model")
    monkeypatch.chdir(chain.root / "artifacts")
    side = side_context(ctx, "register-offline", model_name="tiny-offline")
    result = register.run(side, "model")
    assert attempts == []
    assert result.version == "1"
    mv = side.tracker.client.get_model_version("tiny-offline", "1")
    assert mv.tags["kubellm.kfp_run_id"] == "register-offline"


def test_the_pipeline_version_submit_or_schedule_passed_is_a_lineage_tag(
    ctx: StageContext,
) -> None:
    """KFP names no pipeline version to a step; kubellm submit/schedule pass the YAML's
    version name as the pipeline_version parameter, and the registered model records it."""
    side = side_context(ctx, "with-version", pipeline_version="sha256-0123456789abcdef")
    tags = register.lineage_tags(side)
    assert tags[register.TAG_PIPELINE_VERSION] == "sha256-0123456789abcdef"
