"""MLflow lineage against real stores: sqlite under runs_dir, and a real `mlflow server`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kubellm.backends import resolve
from kubellm.config import PipelineConfig
from kubellm.stages import register
from kubellm.stages.context import StageContext, open_tracker
from kubellm.tracking import SUPPRESS_RUN_URL_ENV, TAG_KFP_RUN, TAG_PARENT, TAG_STAGE
from kubellm.tracking.registry import download_hf_dir, storage_uri
from tracking.mlflow_server import MlflowServer

FINGERPRINT = "sha256:0123abcd"


def _pipeline(cfg: PipelineConfig, kfp_run_id: str) -> StageContext:
    """What preflight does for a pipeline run: open the tracker, start the parent run."""
    tracker = open_tracker(cfg, kfp_run_id)
    parent = tracker.start_parent(f"pipeline-{kfp_run_id}", {"seed": cfg.seed})
    return StageContext(cfg, tracker, parent, kfp_run_id)


def _prepare_data(ctx: StageContext) -> str:
    with ctx.tracker.stage(ctx.parent_run_id, "prepare_data") as run_id:
        ctx.tracker.log(
            run_id, metrics={"records": 100}, tags={"kubellm.data_fingerprint": FINGERPRINT}
        )
    return run_id


def test_parent_and_stage_runs_are_linked(local_cfg: PipelineConfig) -> None:
    ctx = _pipeline(local_cfg, "kfp-run-1")
    client = ctx.tracker.client
    parent = client.get_run(ctx.parent_run_id)
    assert parent.data.tags[TAG_KFP_RUN] == "kfp-run-1"
    assert parent.data.tags[TAG_STAGE] == "pipeline"
    assert parent.data.params == {"seed": "0"}
    assert TAG_PARENT not in parent.data.tags

    data_run = _prepare_data(ctx)
    with ctx.tracker.stage(ctx.parent_run_id, "train") as train_run:
        ctx.tracker.log(train_run, metrics={"loss": 1.5})

    children = ctx.tracker.children(ctx.parent_run_id)
    assert [c.info.run_id for c in children] == [data_run, train_run]
    for child, stage in zip(children, ["prepare_data", "train"], strict=True):
        assert child.data.tags[TAG_PARENT] == ctx.parent_run_id
        assert child.data.tags[TAG_KFP_RUN] == "kfp-run-1"
        assert child.data.tags[TAG_STAGE] == stage
        assert child.info.run_name == stage
        assert child.info.status == "FINISHED"
    assert client.get_run(train_run).data.metrics == {"loss": 1.5}
    assert set(ctx.stage_runs()) == {"prepare_data", "train"}

    ctx.tracker.finish_parent(ctx.parent_run_id, succeeded=True)
    assert client.get_run(ctx.parent_run_id).info.status == "FINISHED"
    # runs of the local platform live in this runs_dir (sqlite store, artifact root)
    exp = client.get_experiment(ctx.tracker.experiment_id)
    assert exp.name == local_cfg.experiment_name
    assert exp.artifact_location == (Path(local_cfg.runs_dir) / "mlartifacts").as_uri()


def test_failing_stage_is_marked_failed_and_reraises(local_cfg: PipelineConfig) -> None:
    ctx = _pipeline(local_cfg, "kfp-run-2")
    with (
        pytest.raises(ValueError, match="loss is NaN"),
        ctx.tracker.stage(ctx.parent_run_id, "train") as run_id,
    ):
        raise ValueError("loss is NaN at step 12")
    run = ctx.tracker.client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.info.end_time is not None
    assert run.data.tags["kubellm.error"] == "loss is NaN at step 12"
    assert run.data.tags[TAG_PARENT] == ctx.parent_run_id

    ctx.tracker.finish_parent(ctx.parent_run_id, succeeded=False)
    assert ctx.tracker.client.get_run(ctx.parent_run_id).info.status == "FAILED"


def test_find_parent_by_kfp_run_id(local_cfg: PipelineConfig) -> None:
    first = _pipeline(local_cfg, "kfp-run-a")
    second = _pipeline(local_cfg, "kfp-run-b")
    assert first.tracker.experiment_id == second.tracker.experiment_id  # opened, not recreated
    _prepare_data(first)  # a stage run carries the KFP run id too, but is not the parent

    assert open_tracker(local_cfg, "kfp-run-a").find_parent() == first.parent_run_id
    assert open_tracker(local_cfg, "kfp-run-b").find_parent() == second.parent_run_id
    assert open_tracker(local_cfg, "kfp-run-unknown").find_parent() is None


def _assert_registered_with_lineage(
    client: MlflowClient, ctx: StageContext, version: str, data_run: str | None
) -> None:
    name = ctx.cfg.model_name
    mv = client.get_model_version_by_alias(name, "challenger")
    assert str(mv.version) == version  # int from the sqlite store, str over REST
    assert mv.tags[TAG_KFP_RUN] == ctx.kfp_run_id
    assert mv.tags["kubellm.pipeline_run"] == ctx.parent_run_id
    assert mv.tags["kubellm.trainer_image"] == ctx.cfg.trainer_image
    if data_run is None:
        assert "kubellm.data_fingerprint" not in mv.tags
    else:
        assert mv.tags["kubellm.data_fingerprint"] == FINGERPRINT
    register_run = client.get_run(mv.run_id)
    assert register_run.data.tags[TAG_STAGE] == "register"
    assert register_run.data.tags[TAG_PARENT] == ctx.parent_run_id
    assert register_run.data.tags["kubellm.model_version"] == version
    assert register_run.info.status == "FINISHED"


def _register_twice(cfg: PipelineConfig, model_dir: Path, run_prefix: str) -> StageContext:
    """Two pipeline runs register the same model: versions 1 then 2, challenger follows."""
    first = _pipeline(cfg, f"{run_prefix}-1")
    data_run = _prepare_data(first)
    with first.tracker.stage(first.parent_run_id, "evaluate") as eval_run:
        first.tracker.log(eval_run, metrics={"exact_match": 0.25, "perplexity": 3.5})
    assert register.run(first, model_dir).version == "1"
    client = first.tracker.client
    _assert_registered_with_lineage(client, first, "1", data_run)
    v1 = client.get_model_version(cfg.model_name, "1")
    assert v1.tags["kubellm.evaluation_run"] == eval_run
    assert v1.tags["exact_match"] == "0.25"
    assert v1.tags["perplexity"] == "3.5"

    second = _pipeline(cfg, f"{run_prefix}-2")
    assert register.run(second, model_dir).version == "2"
    _assert_registered_with_lineage(client, second, "2", None)
    # version 1 keeps its own lineage
    assert client.get_model_version(cfg.model_name, "1").tags[TAG_KFP_RUN] == f"{run_prefix}-1"
    return first


def test_register_creates_versions_with_lineage_sqlite(
    local_cfg: PipelineConfig, tiny_model_dir: Path
) -> None:
    first = _register_twice(local_cfg, tiny_model_dir, "kfp-reg")
    mv = first.tracker.client.get_model_version(local_cfg.model_name, "1")
    # an MLflow transformers model (MLmodel + model/ + components/tokenizer/), logged once
    assert mv.source == f"models:/{mv.tags['kubellm.logged_model']}"
    stored = Path(storage_uri(first.tracker.client, mv).removeprefix("file://"))
    assert stored.is_relative_to(Path(local_cfg.runs_dir) / "mlartifacts" / "models")
    weights = (stored / "model" / "model.safetensors").read_bytes()
    assert weights == (tiny_model_dir / "model.safetensors").read_bytes()
    assert (stored / "MLmodel").is_file()


def test_register_against_a_real_mlflow_server(
    mlflow_server: MlflowServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = resolve(PipelineConfig(platform="kubernetes", mlflow_tracking_uri=mlflow_server.url))
    assert cfg.mlflow_tracking_uri == mlflow_server.url
    _register_twice(cfg, tiny_model_dir, "kfp-srv")

    client = MlflowClient(tracking_uri=mlflow_server.url)  # a fresh client, as a reader would
    mv = client.get_model_version(cfg.model_name, "1")
    assert mv.status == "READY"
    local = download_hf_dir(client, mv, tmp_path / "dl")
    assert (local / "config.json").is_file() and (local / "tokenizer.json").is_file()
    assert (local / "model.safetensors").read_bytes() == (
        tiny_model_dir / "model.safetensors"
    ).read_bytes()
    # the server, not this process, stored them: proxied to --artifacts-destination
    uploaded = list(mlflow_server.artifacts.rglob("config.json"))
    assert len(uploaded) == 2, uploaded  # one per registered version
    # registered from the LoggedModel: its models:/ URI, which the server resolved itself
    model_id = mv.tags["kubellm.logged_model"]
    assert mv.source == f"models:/{model_id}", mv.source
    logged = client.get_logged_model(model_id)
    listed = json.loads(logged.tags["mlflow.modelVersions"])  # the server's, version an int
    assert [(v["name"], str(v["version"])) for v in listed] == [(cfg.model_name, "1")]
    # the first run's evaluate figures are the LoggedModel's metrics, naming that run
    evaluation = mv.tags["kubellm.evaluation_run"]
    assert {m.key: (m.value, m.run_id) for m in logged.metrics} == {
        "exact_match": (0.25, evaluation),
        "perplexity": (3.5, evaluation),
    }
    # and the version's files are the proxied location, not a path on this machine
    stored = storage_uri(client, mv)
    assert stored.startswith("mlflow-artifacts:"), stored


SECRET = "s3cr3t-pw"


def test_a_password_in_the_tracking_uri_reaches_no_param_report_or_output(
    mlflow_server: MlflowServer,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 23: `user:pass@` in mlflow_tracking_uri, through preflight (the parent run logs
    the whole config; preflight logs the URI and shows it in its report) against a real
    `mlflow server`, which ignores the credentials: nothing MLflow stores or the step
    prints holds the password."""
    from kubellm.stages import preflight
    from stages.conftest import TINY

    monkeypatch.delenv(SUPPRESS_RUN_URL_ENV, raising=False)  # the step sets it: undone after
    uri = mlflow_server.url.replace("http://", f"http://kubellm:{SECRET}@")
    params = {**TINY, "runs_dir": str(tmp_path / "runs"), "mlflow_tracking_uri": uri}
    result = preflight.run(params, "kfp-secret")
    out = capfd.readouterr()
    assert "kubellm:***@127.0.0.1" in result.report
    client = MlflowClient(tracking_uri=mlflow_server.url)
    parent = client.get_run(result.parent_run_id)
    runs = [parent, *client.search_runs([parent.info.experiment_id])]
    stored = [str(r.data.params) + str(r.data.tags) for r in runs]
    assert parent.data.params["mlflow_tracking_uri"] == uri.replace(SECRET, "***")
    reports = [
        client.download_artifacts(r.info.run_id, "report.md", str(tmp_path / r.info.run_id))
        for r in runs
        if any(a.path == "report.md" for a in client.list_artifacts(r.info.run_id))
    ]
    assert reports  # preflight's report is stored
    texts = [*stored, *(Path(p).read_text() for p in reports), result.report]
    texts += [result.headline, out.out, out.err]
    leaks = [t[max(0, t.index(SECRET) - 200) : t.index(SECRET) + 50] for t in texts if SECRET in t]
    assert leaks == []
    # the URI itself still works: the runs were made through it
    assert PipelineConfig.model_validate_json(result.config).mlflow_tracking_uri == uri


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://u:p@h:5000/x", "http://u:***@h:5000/x"),
        ("https://token@h", "https://***@h"),
        ("a http://u:p@h and s3://k:s@b/x", "a http://u:***@h and s3://k:***@b/x"),
        ("sqlite:///runs/a@b.db", "sqlite:///runs/a@b.db"),
        ("user@example.com", "user@example.com"),
    ],
)
def test_redact_hides_the_password_of_every_url(text: str, shown: str) -> None:
    from kubellm.redact import redact

    assert redact(text) == shown
