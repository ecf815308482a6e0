"""`kubellm submit` against a fake KFP API server that checks runs as the real one does."""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from fakes.fake_kfp import API, FakeKfp, isolate_kfp_client
from kubellm.cli import main
from kubellm.kfp.client import (
    backend_version_error,
    parse_backend_version,
    read_cookie_file,
    resolve_token,
    run_link,
    ui_base,
    version_name,
)

PIPELINE = Path(__file__).parents[1] / "pipelines" / "llm_train.yaml"

pytestmark = pytest.mark.filterwarnings("ignore:This client only works:FutureWarning")


@pytest.fixture(autouse=True)
def _isolated_kfp_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_kfp_client(monkeypatch, tmp_path)


@pytest.fixture
def fake() -> Iterator[FakeKfp]:
    with FakeKfp() as server:
        yield server


def _submit(*args: str) -> int:
    return main(["submit", str(PIPELINE), *args])


# -- the CLI against the fake ------------------------------------------------------------


def test_submit_sends_typed_overrides(fake: FakeKfp, capsys: pytest.CaptureFixture[str]) -> None:
    rc = _submit(
        "--endpoint",
        fake.url,
        "--experiment",
        "nightly",
        "--run-name",
        "kubellm-test-run",
        "--set",
        "train_steps=7",
        "--set",
        "gate_min_accuracy=0",
        "--set",
        "learning_rate=0.001",
        "--set",
        "model_name=tiny-1",
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert fake.errors == []

    runs = fake.created_runs()
    assert len(runs) == 1
    run = runs[0]
    params = run["runtime_config"]["parameters"]
    # exactly the overrides given, nothing else (the pipeline's defaults stay on the server)
    params = dict(params)
    assert params.pop("pipeline_version") == version_name(str(PIPELINE))  # for the registry
    assert params == {
        "train_steps": 7,
        "gate_min_accuracy": 0.0,
        "learning_rate": 0.001,
        "model_name": "tiny-1",
    }
    # typed as the pipeline declares them: `0` on the command line is a double on the wire
    assert type(params["gate_min_accuracy"]) is float
    assert type(params["train_steps"]) is int
    assert run["display_name"] == "kubellm-test-run"
    # steps run as the ServiceAccount whose Role lets them create jobs (manifests/base)
    assert run["service_account"] == "kubellm-pipeline"
    # the run references the version its `pipeline_version` names, uploaded first
    assert "pipeline_spec" not in run
    ref = run["pipeline_version_reference"]
    (version,) = fake.versions.values()
    assert ref == {
        "pipeline_id": version["pipeline_id"],
        "pipeline_version_id": version["pipeline_version_id"],
    }
    assert version["display_name"] == version_name(str(PIPELINE))
    assert fake.pipelines[ref["pipeline_id"]]["display_name"] == "kubellm-llm-train"
    spec = version["pipeline_spec"]["pipeline_spec"]
    assert spec["pipelineInfo"]["name"] == "kubellm-llm-train"

    (experiment,) = fake.experiments.values()
    assert experiment["display_name"] == "nightly"
    assert run["experiment_id"] == experiment["experiment_id"]

    (run_id,) = fake.runs
    assert f"submitted run {run_id} (kubellm-test-run) to {fake.url}" in out
    assert f"{fake.url}/#/runs/details/{run_id}" in out


def test_submit_with_another_service_account(fake: FakeKfp) -> None:
    assert _submit("--endpoint", fake.url, "--service-account", "team-a-runner") == 0
    (run,) = fake.created_runs()
    assert run["service_account"] == "team-a-runner"
    assert fake.errors == []


def test_submit_reuses_an_existing_experiment(fake: FakeKfp) -> None:
    existing = fake.add_experiment("kubellm")
    assert _submit("--endpoint", fake.url, "--set", "tune_trials=0") == 0  # default experiment
    assert fake.errors == []
    assert list(fake.experiments) == [existing["experiment_id"]]
    assert not [r for r in fake.requests if r.method == "POST" and r.path == f"{API}/experiments"]
    (run,) = fake.created_runs()
    assert run["experiment_id"] == existing["experiment_id"]
    assert run["display_name"].startswith("kubellm-")  # the timestamped default
    assert run["runtime_config"]["parameters"] == {
        "tune_trials": 0,
        "pipeline_version": version_name(str(PIPELINE)),
    }


def test_submit_takes_the_endpoint_from_kfp_endpoint(
    fake: FakeKfp, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KFP_ENDPOINT", fake.url)
    assert _submit("--run-name", "from-env") == 0
    assert fake.errors == []
    (run,) = fake.created_runs()
    assert run["display_name"] == "from-env"
    assert run["runtime_config"]["parameters"] == {"pipeline_version": version_name(str(PIPELINE))}


def test_submit_to_a_profile_namespace_on_multi_user_kfp() -> None:
    with FakeKfp(multi_user=True) as fake:
        assert _submit("--endpoint", fake.url, "--namespace", "team-a") == 0
        assert fake.errors == []
        (experiment,) = fake.experiments.values()
        assert experiment["namespace"] == "team-a"
        lists = [r for r in fake.requests if r.method == "GET" and r.path == f"{API}/experiments"]
        assert lists and all(r.query.get("namespace") == ["team-a"] for r in lists)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train_steps=-1", "train_steps"),
        ("learning_rate=1", "learning_rate"),
        ("nope=1", "nope"),
    ],
)
def test_bad_override_exits_2_and_sends_nothing(
    fake: FakeKfp, capsys: pytest.CaptureFixture[str], override: str, named: str
) -> None:
    rc = _submit("--endpoint", fake.url, "--set", "train_steps=7", "--set", override)
    out, err = capsys.readouterr()
    assert rc == 2
    assert fake.requests == []  # not even the health check: nothing reaches the server
    assert err.startswith("kubellm: error: ")
    assert err.count("\n") == 1, err  # one line
    assert f"'{named}'" in err or f"{named}=" in err, err
    assert "submitted run" not in out


def test_missing_endpoint_exits_2_naming_kfp_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    rc = _submit("--set", "train_steps=7")
    _, err = capsys.readouterr()
    assert rc == 2
    assert "KFP_ENDPOINT" in err
    assert err.count("\n") == 1, err


# -- the fake's own checks (so a passing submit test means something) ----------------------


def _compiled() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = list(yaml.safe_load_all(PIPELINE.read_text()))
    platform = docs[1] if len(docs) > 1 else {}
    return docs[0], platform


@dataclass
class Case:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)
    change: dict[str, Any] = field(default_factory=dict)  # top-level fields of the run body
    drop_from_spec: str = ""  # a top-level key removed from the pipeline spec
    error: str = ""  # expected in the error message; empty: the run is accepted
    status: int = 400  # the status of a refused run


CASES = [
    Case("valid", parameters={"train_steps": 7, "gate_min_accuracy": 0.5}),
    Case("valid int for a double", parameters={"learning_rate": 1}),
    Case(
        "undeclared parameter",
        parameters={"not_a_param": 1},
        error="runtime_config.parameters.not_a_param: not an input parameter",
    ),
    Case(
        "string for an integer",
        parameters={"train_steps": "7"},
        error="train_steps: NUMBER_INTEGER needs an integer",
    ),
    Case(
        "fraction for an integer",
        parameters={"train_steps": 7.5},
        error="train_steps: NUMBER_INTEGER needs an integer",
    ),
    Case(
        "bool for a double",
        parameters={"learning_rate": True},
        error="learning_rate: NUMBER_DOUBLE needs a number",
    ),
    Case(
        "number for a string",
        parameters={"model_name": 5},
        error="model_name: STRING needs a string",
    ),
    Case(
        "unknown experiment",
        change={"experiment_id": "nope"},
        error="Experiment nope not found",
        status=404,  # GetValidExperimentNamespacePair: NotFound
    ),
    Case("no display name", change={"display_name": ""}, error="display_name: required"),
    Case("unknown run field", change={"pipeline": "x"}, error="pipeline: unknown field"),
    Case(
        "spec without deploymentSpec",
        drop_from_spec="deploymentSpec",
        error="deploymentSpec.executors: required",
    ),
    Case(
        "spec without pipelineInfo",
        drop_from_spec="pipelineInfo",
        error="pipelineInfo.name: required",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fake_checks_run_creates(fake: FakeKfp, case: Case) -> None:
    experiment = fake.add_experiment("direct")
    spec, platform = _compiled()
    spec = copy.deepcopy(spec)
    if case.drop_from_spec:
        del spec[case.drop_from_spec]
    body: dict[str, Any] = {
        "display_name": "direct-run",
        "experiment_id": experiment["experiment_id"],
        "pipeline_spec": {"pipeline_spec": spec, "platform_spec": platform},
        "runtime_config": {"parameters": case.parameters},
        **case.change,
    }
    resp = requests.post(f"{fake.url}{API}/runs", json=body, timeout=10)
    if not case.error:
        assert resp.status_code == 200, resp.text
        assert resp.json()["state"] == "PENDING"
        assert resp.json()["run_id"] in fake.runs
        assert fake.errors == []
        return
    assert resp.status_code == case.status
    assert case.error in resp.json()["message"]
    assert fake.runs == {}
    assert len(fake.errors) >= 1
    assert any(case.error in e for e in fake.errors)


def test_fake_puts_a_run_without_an_experiment_in_the_default_one(fake: FakeKfp) -> None:
    """resource_manager.go GetValidExperimentNamespacePair: no experiment_id is the default
    experiment (created when missing) in single-user mode, a 400 in multi-user mode."""
    spec, platform = _compiled()
    body = {
        "display_name": "direct-run",
        "pipeline_spec": {"pipeline_spec": spec, "platform_spec": platform},
    }
    for _ in range(2):
        resp = requests.post(f"{fake.url}{API}/runs", json=body, timeout=10)
        assert resp.status_code == 200, resp.text
    (default,) = fake.experiments.values()
    assert default["display_name"] == "Default"
    assert {r["experiment_id"] for r in fake.runs.values()} == {default["experiment_id"]}
    with FakeKfp(multi_user=True) as multi:
        resp = requests.post(f"{multi.url}{API}/runs", json=body, timeout=10)
        assert resp.status_code == 400
        assert "Experiment id can not be empty in multi-user mode" in resp.json()["message"]


def test_submit_of_a_pipeline_lacking_a_parameter_is_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A YAML compiled without a parameter the CLI knows about: the server refuses the run."""
    spec, platform = _compiled()
    del spec["root"]["inputDefinitions"]["parameters"]["train_steps"]
    narrowed = tmp_path / "narrow.yaml"
    narrowed.write_text(yaml.safe_dump_all([spec, platform], sort_keys=False))
    with FakeKfp() as fake:
        # the server's 400 is a one-line CLI error with exit code 2, not a traceback
        rc = main(["submit", str(narrowed), "--endpoint", fake.url, "--set", "train_steps=7"])
        out, err = capsys.readouterr()
        assert rc == 2, err
        assert err.startswith(f"kubellm: error: KFP at {fake.url} refused the run (400): "), err
        assert "train_steps: not an input parameter" in err
        assert err.count("\n") == 1, err
        assert "submitted run" not in out
        assert fake.runs == {}
        assert len(fake.created_runs()) == 1
        assert [e for e in fake.errors if "train_steps: not an input parameter" in e]


# -- auth ---------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["--token-file", "KFP_TOKEN", "KF_PIPELINES_SA_TOKEN_PATH"])
def test_submit_sends_the_bearer_token(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")  # as a projected token or `kubectl create token` leaves it
    extra: list[str] = []
    if how == "--token-file":
        extra = ["--token-file", str(token)]
    elif how == "KFP_TOKEN":
        monkeypatch.setenv("KFP_TOKEN", "s3cret")
    else:
        monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token))
    with FakeKfp(token="s3cret") as fake:
        assert _submit("--endpoint", fake.url, *extra) == 0
        assert fake.errors == []
        assert len(fake.runs) == 1


def test_submit_without_the_token_is_a_quick_one_line_401(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with FakeKfp(token="s3cret") as fake:
        started = time.monotonic()
        rc = _submit("--endpoint", fake.url)
        elapsed = time.monotonic() - started
        _, err = capsys.readouterr()
        assert rc == 2
        assert elapsed < 5  # kfp's own health check retries 5 times, 5 s apart
        assert err.startswith(f"kubellm: error: KFP at {fake.url} refused connecting (401): ")
        assert "--token-file" in err
        assert err.count("\n") == 1, err
        assert fake.runs == {}


def test_an_unreadable_token_file_is_an_error_before_anything_is_sent(
    fake: FakeKfp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "missing", tmp_path / "empty"):
        assert _submit("--endpoint", fake.url, "--token-file", str(path)) == 2
        _, err = capsys.readouterr()
        assert str(path) in err and "--token-file" in err
        assert err.count("\n") == 1
    assert fake.requests == []


def test_token_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flag, sa = tmp_path / "flag", tmp_path / "sa"
    flag.write_text("from-flag")
    sa.write_text("from-sa")
    env = {"KFP_TOKEN": "from-env", "KF_PIPELINES_SA_TOKEN_PATH": str(sa)}
    cases = [
        (str(flag), env, None, str(flag)),  # the flag wins
        (None, env, "from-env", None),  # then $KFP_TOKEN
        (None, {"KF_PIPELINES_SA_TOKEN_PATH": str(sa)}, None, str(sa)),  # then kfp's variable
    ]
    for flag_arg, environ, value, path in cases:
        token = resolve_token(flag_arg, environ)
        assert token is not None
        assert (token.value, token.path) == (value, path)
    assert resolve_token(None, {}) is None
    # in a pod, kfp's projected token file is used when nothing else is given
    monkeypatch.setattr("kubellm.kfp.client.SA_TOKEN_PATH", str(sa))
    token = resolve_token(None, {})
    assert token is not None and token.path == str(sa)


# -- sign-in: the identity header, the session cookie ------------------------------------

ALICE = "alice@example.com"
SESSION = "oauth2_proxy_kubeflow=c2Vzc2lvbi12YWx1ZQ=="  # the value is base64, '=' and all


def _cookie_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "cookie"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_submit_with_user_sends_the_kubeflow_userid_header(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A port-forward to a multi-user install's ml-pipeline: no gateway adds the identity."""
    with FakeKfp(multi_user=True, user=ALICE) as fake:
        assert _submit("--endpoint", fake.url, "--namespace", "team-a", "--user", ALICE) == 0
        assert fake.errors == []
        assert len(fake.runs) == 1
        assert fake.requests and all(r.header("kubeflow-userid") == [ALICE] for r in fake.requests)

        assert _submit("--endpoint", fake.url, "--namespace", "team-a") == 2  # without: 401
        _, err = capsys.readouterr()
        assert " refused the run (401): " in err and "--user" in err and "--cookie-file" in err
        assert err.count("\n") == 1, err
        assert len(fake.runs) == 1


def test_submit_as_another_user_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeKfp(multi_user=True, user=ALICE) as fake:
        rc = _submit("--endpoint", fake.url, "--namespace", "team-a", "--user", "bob@example.com")
        _, err = capsys.readouterr()
        assert rc == 2
        assert " refused the run (403): User 'bob@example.com' is not authorized" in err, err
        assert err.count("\n") == 1, err
        assert fake.runs == {}


def test_submit_with_cookie_file_sends_the_session_cookie(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the Kubeflow gateway after a Dex sign-in: the cookie is the identity."""
    cookie = _cookie_file(tmp_path, SESSION + "\n")
    with FakeKfp(multi_user=True, user=ALICE, session_cookie=SESSION) as fake:
        args = ("--endpoint", fake.url, "--namespace", "team-a")
        assert _submit(*args, "--cookie-file", str(cookie)) == 0
        out, err = capsys.readouterr()
        assert fake.errors == []
        assert len(fake.runs) == 1
        assert all(r.header("Cookie") == [SESSION] for r in fake.requests)
        assert "c2Vzc2lvbi12YWx1ZQ" not in out + err  # the secret is never printed
        assert err == ""  # 0600: no warning

        assert _submit(*args) == 2  # without it, oauth2-proxy's 401 for /apis/
        _, err = capsys.readouterr()
        assert " refused connecting (401): " in err and "--cookie-file" in err, err
        assert len(fake.runs) == 1


def test_a_cookie_file_others_can_read_draws_a_warning_not_its_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cookie = _cookie_file(tmp_path, SESSION, mode=0o644)
    with FakeKfp(multi_user=True, user=ALICE, session_cookie=SESSION) as fake:
        args = ("--endpoint", fake.url, "--namespace", "team-a", "--cookie-file", str(cookie))
        assert _submit(*args) == 0
        _, err = capsys.readouterr()
        assert err == (
            f"kubellm: warning: the cookie file {cookie} (--cookie-file) is readable by others "
            f"(mode 644); chmod 600 {cookie}\n"
        )
        assert len(fake.runs) == 1


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (None, "cannot read the cookie file"),
        ("", "holds no cookie"),
        ("# only a comment\n\n", "holds no cookie"),
        ("c2VjcmV0LXRva2Vu\n", "line 1: not a name=value cookie"),
        ("ok=1\n=c2VjcmV0\n", "line 2: not a name=value cookie"),
        ("oauth2_proxy_kubeflow=\n", "line 1: not a name=value cookie"),
        ("bad name=c2VjcmV0\n", "line 1: not a name=value cookie"),
        (
            "kubeflow.example.com\tFALSE\t/\tTRUE\t0\toauth2_proxy_kubeflow\tc2VjcmV0\n",
            "line 1: looks like a Netscape cookies.txt line",
        ),
    ],
    ids=["missing", "empty", "comments", "bare", "no-name", "no-value", "space", "netscape"],
)
def test_a_missing_or_malformed_cookie_file_is_one_line_before_anything_is_sent(
    fake: FakeKfp, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, why: str
) -> None:
    path = tmp_path / "missing" if text is None else _cookie_file(tmp_path, text)
    assert _submit("--endpoint", fake.url, "--cookie-file", str(path)) == 2
    _, err = capsys.readouterr()
    assert err.startswith("kubellm: error: "), err
    assert why in err and str(path) in err and "--cookie-file" in err, err
    assert "c2VjcmV0" not in err  # the content never shows
    assert err.count("\n") == 1, err
    assert fake.requests == []


def test_cookie_file_forms(tmp_path: Path) -> None:
    """The browser's Cookie header as copied, or one cookie a line; `#` lines skipped."""
    for text in ("a=1; b=x=y=", "# from the browser\na=1\n\nb=x=y=\n", " a=1 ;b=x=y=;\n"):
        assert read_cookie_file(str(_cookie_file(tmp_path, text))) == "a=1; b=x=y="


# -- the version the run names ------------------------------------------------------------


def test_submit_creates_the_version_it_tags(tmp_path: Path) -> None:
    """The `pipeline_version` a run carries (the registry's tag) is a version on the server:
    uploaded on the first submit, reused by the next, a new one for a changed YAML."""
    with FakeKfp() as fake:
        assert _submit("--endpoint", fake.url) == 0
        assert _submit("--endpoint", fake.url) == 0
        assert fake.errors == []
        (pipeline,) = fake.pipelines.values()
        (version,) = fake.versions.values()
        assert version["display_name"] == version_name(str(PIPELINE))
        for run in fake.runs.values():
            assert (
                run["runtime_config"]["parameters"]["pipeline_version"] == (version["display_name"])
            )
            assert run["pipeline_version_reference"] == {
                "pipeline_id": pipeline["pipeline_id"],
                "pipeline_version_id": version["pipeline_version_id"],
            }
        got = requests.get(
            f"{fake.url}{API}/pipelines/{pipeline['pipeline_id']}/versions/"
            f"{version['pipeline_version_id']}",
            timeout=10,
        )
        assert got.ok and got.json()["display_name"] == version_name(str(PIPELINE))

        docs = list(yaml.safe_load_all(PIPELINE.read_text()))
        docs[0]["pipelineInfo"]["description"] = "changed"
        changed = tmp_path / "changed.yaml"
        changed.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        assert main(["submit", str(changed), "--endpoint", fake.url]) == 0
        assert fake.errors == []
        assert len(fake.pipelines) == 1 and len(fake.versions) == 2
        newest = fake.created_runs()[-1]
        (new,) = [
            v for v in fake.versions.values() if v["display_name"] != version_name(str(PIPELINE))
        ]
        assert new["display_name"] == version_name(str(changed))
        assert (
            newest["pipeline_version_reference"]["pipeline_version_id"]
            == new["pipeline_version_id"]
        )
        assert newest["runtime_config"]["parameters"]["pipeline_version"] == new["display_name"]


# -- the UI link --------------------------------------------------------------------------


@dataclass
class LinkCase:
    endpoint: str
    ui: str | None  # --ui-url
    want: str | None  # the UI base; None: no link can be known


LINK_CASES = [
    LinkCase("http://localhost:8888", None, None),  # port-forward of svc/ml-pipeline: the API
    LinkCase("http://ml-pipeline.kubeflow:8888", None, None),
    LinkCase("http://ml-pipeline.kubeflow.svc.cluster.local:8888/", None, None),
    LinkCase("http://localhost:8888", "http://localhost:8080", "http://localhost:8080"),
    LinkCase(
        "https://kubeflow.example.com/pipeline", None, "https://kubeflow.example.com/_/pipeline"
    ),
    LinkCase(
        "https://kubeflow.example.com/pipeline/", None, "https://kubeflow.example.com/_/pipeline"
    ),
    LinkCase("http://localhost:8080", None, "http://localhost:8080"),  # svc/ml-pipeline-ui
    LinkCase("https://kfp.example.com/", "kfp-ui.example.com/", "http://kfp-ui.example.com"),
]


@pytest.mark.parametrize("case", LINK_CASES, ids=[f"{c.endpoint} {c.ui}" for c in LINK_CASES])
def test_ui_base(case: LinkCase) -> None:
    assert ui_base(case.endpoint, case.ui) == case.want
    line = run_link(case.endpoint, case.ui, "RUN")
    if case.want is None:
        assert line.startswith("no UI link: ") and "--ui-url" in line
    else:
        assert line == f"{case.want}/#/runs/details/RUN"


def test_ui_endpoint_from_kfp_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KF_PIPELINES_UI_ENDPOINT", "https://ui.example.com/")
    assert run_link("http://localhost:8888", None, "R") == "https://ui.example.com/#/runs/details/R"
    assert run_link("http://localhost:8888", "http://flag", "R") == "http://flag/#/runs/details/R"


def test_submit_to_the_api_server_says_there_is_no_ui_link(
    fake: FakeKfp, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake stands in for ml-pipeline:8888 (its port counts as the API's)."""
    port = int(fake.url.rsplit(":", 1)[1])
    monkeypatch.setattr("kubellm.kfp.client.API_PORTS", {port})
    assert _submit("--endpoint", fake.url) == 0
    out, _ = capsys.readouterr()
    (run_id,) = fake.runs
    assert (
        out.splitlines()[0]
        == f"submitted run {run_id} ({fake.created_runs()[0]['display_name']}) to {fake.url}, "
        f"pipeline version {version_name(str(PIPELINE))}"
    )
    assert out.splitlines()[1].startswith(f"no UI link: {fake.url} is the KFP API server")
    assert "#/runs/details" not in out  # not even kfp's own "Run details:" line
    assert _submit("--endpoint", fake.url, "--ui-url", "http://localhost:8080") == 0
    out, _ = capsys.readouterr()
    run_id = next(r for r in fake.runs if r != run_id)
    assert out.splitlines()[-1] == f"http://localhost:8080/#/runs/details/{run_id}"


# -- the README's kfp CLI line ------------------------------------------------------------


def _readme_kfp_line() -> str:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    lines = [ln.strip() for ln in readme.splitlines() if ln.strip().startswith("kfp --endpoint ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("verb", ["create", "submit"])
def test_readme_kfp_cli_line_creates_a_typed_run(fake: FakeKfp, tmp_path: Path, verb: str) -> None:
    """The line as written, with the fake's URL for the endpoint, through the real kfp CLI;
    and with `run submit`, the deprecated alias the README says also works."""
    argv = shlex.split(_readme_kfp_line())
    assert argv[argv.index("run") + 1] == "create"
    argv[argv.index("run") + 1] = verb
    endpoint = argv[argv.index("--endpoint") + 1]
    argv[argv.index("--endpoint") + 1] = fake.url
    kfp_cli = Path(sys.executable).parent / "kfp"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KF_PIPELINES", "KFP_"))}
    env["HOME"] = str(tmp_path)  # no ~/.config/kfp context from this machine
    proc = subprocess.run(
        [str(kfp_cli), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert fake.errors == []
    assert re.match(r"https?://", endpoint)
    (run,) = fake.created_runs()
    pairs = [a for a in argv if "=" in a and not a.startswith("-")]
    assert pairs, "the README line sets a parameter"
    params = run["runtime_config"]["parameters"]
    assert set(params) == {p.split("=", 1)[0] for p in pairs}
    assert type(params["train_steps"]) is int  # typed, not the string "5000"
    (experiment,) = fake.experiments.values()
    assert experiment["display_name"] == argv[argv.index("-e") + 1]
    assert run["experiment_id"] == experiment["experiment_id"]
    assert run["display_name"]


# -- the backend version ------------------------------------------------------------------

NEEDS = "kubellm needs KFP backend 2.16 or newer (2.17 recommended; README 'Supported versions')"


@pytest.mark.parametrize("tag", ["2.5.0", "2.4.1", "2.14.4", "2.15.0"])
def test_submit_refuses_an_older_backend_in_one_line(
    capsys: pytest.CaptureFixture[str], tag: str
) -> None:
    """Kubeflow 1.10's KFP 2.5 cannot run the compiled YAML (the exit handler's final status,
    optional Secret env, the security context, nested dsl.If state), nor can 2.15 (its
    compiler refuses the security context): refused before a run."""
    with FakeKfp(tag_name=tag) as fake:
        rc = _submit("--endpoint", fake.url, "--set", "train_steps=7")
        out, err = capsys.readouterr()
        assert rc == 2
        assert err == f"kubellm: error: KFP at {fake.url} runs backend {tag}; {NEEDS}\n"
        assert out == ""
        assert fake.created_runs() == [] and fake.runs == {} and fake.experiments == {}
        assert [(r.method, r.path) for r in fake.requests] == [("GET", f"{API}/healthz")]


@pytest.mark.parametrize("tag", ["2.16.0", "2.16.1", "2.17.0", "v2.17.0"])
def test_submit_proceeds_on_a_backend_at_or_past_the_minimum(tag: str) -> None:
    with FakeKfp(tag_name=tag) as fake:
        assert _submit("--endpoint", fake.url, "--set", "train_steps=7") == 0
        assert fake.errors == []
        assert len(fake.runs) == 1
        # asked first, with the same client (and so the same token) the run goes out with
        assert (fake.requests[0].method, fake.requests[0].path) == ("GET", f"{API}/healthz")


@pytest.mark.parametrize("tag", ["unknown", "master", ""])
def test_a_backend_that_does_not_say_is_refused_unless_skipped(
    capsys: pytest.CaptureFixture[str], tag: str
) -> None:
    """Official images 2.4.0-2.15.x answer `unknown` (no TAG_NAME build-arg before 2.16.0),
    as may a build of one's own: only the image tag can date it, so the user says so."""
    with FakeKfp(tag_name=tag) as fake:
        assert _submit("--endpoint", fake.url) == 2
        _, err = capsys.readouterr()
        assert err.startswith(
            f"kubellm: error: KFP at {fake.url} does not announce its backend version "
            f"(/apis/v2beta1/healthz answered tag_name {tag!r}, "
        ), err
        assert NEEDS in err and "--skip-version-check" in err and "ml-pipeline" in err
        assert err.count("\n") == 1, err
        assert fake.runs == {}

        assert _submit("--endpoint", fake.url, "--skip-version-check") == 0
        assert fake.errors == [] and len(fake.runs) == 1


def test_skip_version_check_sends_to_an_old_backend_which_refuses_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Skipped, the run reaches a 2.15 server, whose compiler refuses it (see below)."""
    with FakeKfp(tag_name="2.15.0") as fake:
        assert _submit("--endpoint", fake.url, "--skip-version-check") == 2
        _, err = capsys.readouterr()
        assert err.startswith(f"kubellm: error: KFP at {fake.url} refused the run (500): ")
        assert "securityContext" in err and err.count("\n") == 1, err
        assert fake.runs == {}


@pytest.mark.parametrize(
    ("tag", "parsed"),
    [
        ("2.17.0", (2, 17, 0)),
        ("v2.15.1", (2, 15, 1)),
        ("2.16.0-rc.1", (2, 16, 0)),
        ("2.5", (2, 5, 0)),
        ("unknown", None),
        ("master", None),
        ("1.0-dev", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_backend_version(tag: Any, parsed: tuple[int, int, int] | None) -> None:
    assert parse_backend_version(tag) == parsed


def test_a_healthz_that_is_not_json_is_refused_in_one_line() -> None:
    """An auth proxy's HTML login page at /apis/...: not a version, not a traceback."""
    error = backend_version_error("https://kf.example.com/pipeline", None)
    assert error is not None and "\n" not in error
    assert "answered a body that is not JSON" in error and "--skip-version-check" in error


@pytest.mark.parametrize(
    ("tag", "v2", "v1"),
    [
        (
            "2.17.0",
            {
                "commit_sha": "unknown",
                "tag_name": "2.17.0",
                "multi_user": False,
                "pipeline_store": "database",
            },
            {"commit_sha": "unknown", "tag_name": "2.17.0", "multi_user": False},
        ),
        (
            "2.5.0",
            {"commit_sha": "unknown", "tag_name": "2.5.0", "multi_user": False},
            {"commit_sha": "unknown", "tag_name": "2.5.0", "multi_user": False},
        ),
    ],
)
def test_fake_healthz_is_the_api_servers_http_handler(
    tag: str, v2: dict[str, Any], v1: dict[str, Any]
) -> None:
    """main.go's handler, not the proto's GetHealthzResponse (which has no version)."""
    with FakeKfp(tag_name=tag) as fake:
        assert requests.get(f"{fake.url}/apis/v2beta1/healthz", timeout=10).json() == v2
        assert requests.get(f"{fake.url}/apis/v1beta1/healthz", timeout=10).json() == v1


def _direct_run(fake: FakeKfp, platform: dict[str, Any]) -> requests.Response:
    experiment = fake.add_experiment("direct")
    spec, _ = _compiled()
    body = {
        "display_name": "direct-run",
        "experiment_id": experiment["experiment_id"],
        "pipeline_spec": {"pipeline_spec": spec, "platform_spec": platform},
    }
    return requests.post(f"{fake.url}{API}/runs", json=body, timeout=10)


def test_fake_at_2_15_refuses_the_compiled_security_context() -> None:
    """Why the minimum is 2.16, not 2.15: the 2.15 API server's compiler parses each
    executor's Kubernetes config strictly, and its proto has no securityContext."""
    _, platform = _compiled()
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert any("securityContext" in e for e in executors.values())  # set_security_context
    with FakeKfp(tag_name="2.15.0") as fake:
        resp = _direct_run(fake, platform)
        assert resp.status_code == 500
        message = resp.json()["message"]
        assert message.startswith("Internal error: Failed to generate the ExecutionSpec: ")
        assert "failed to unmarshal kubernetes config" in message and "securityContext" in message
        assert fake.runs == {}
    with FakeKfp(tag_name="2.16.0") as fake:
        assert _direct_run(fake, platform).status_code == 200
        assert fake.errors == []


def test_fake_refuses_an_unknown_kubernetes_executor_field() -> None:
    _, platform = _compiled()
    platform = copy.deepcopy(platform)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    next(iter(executors.values()))["secretAsEnvv"] = []
    with FakeKfp() as fake:
        resp = _direct_run(fake, platform)
        assert resp.status_code == 500
        assert "secretAsEnvv" in resp.json()["message"]
        assert fake.runs == {}
