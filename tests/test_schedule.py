"""`kubellm schedule` against the fake KFP API server, and the cron rules KFP applies."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from fakes.fake_kfp import API, FakeKfp, isolate_kfp_client
from kubellm.cli import main
from kubellm.commands.schedule import kfp_cron, robfig_cron_error
from kubellm.kfp.client import version_name

PIPELINE = Path(__file__).parents[1] / "pipelines" / "llm_train.yaml"
NAME = "kubellm-llm-train"  # the pipeline's pipelineInfo.name: the default --name

pytestmark = pytest.mark.filterwarnings("ignore:This client only works:FutureWarning")


@pytest.fixture(autouse=True)
def _isolated_kfp_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_kfp_client(monkeypatch, tmp_path)


@pytest.fixture
def fake() -> Iterator[FakeKfp]:
    with FakeKfp() as server:
        yield server


def _schedule(fake: FakeKfp, *args: str, pipeline: Path | None = PIPELINE) -> int:
    head = [str(pipeline)] if pipeline else []
    return main(["schedule", *head, "--endpoint", fake.url, *args])


def _posts(fake: FakeKfp, path: str) -> int:
    return len([r for r in fake.requests if r.method == "POST" and r.path == f"{API}{path}"])


# -- create, update, pause, resume, delete, list -------------------------------------------


def test_schedule_creates_one_recurring_run_of_an_uploaded_version(
    fake: FakeKfp, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = _schedule(fake, "--cron", "0 2 * * *", "--set", "train_steps=7", "--set", "gate_margin=0")
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert fake.errors == []

    (run,) = fake.recurring_runs.values()
    assert run["display_name"] == NAME
    # crontab's 02:00 daily, with the seconds field robfig/cron's Parse reads first
    assert run["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *"}}
    assert run["mode"] == "ENABLE"
    assert run["no_catchup"] is True
    assert run["max_concurrency"] == "1"
    assert run["service_account"] == "kubellm-pipeline"
    params = dict(run["runtime_config"]["parameters"])
    version_param = params.pop("pipeline_version")
    assert params == {"train_steps": 7, "gate_margin": 0.0}
    (sent,) = fake.created_recurring_runs()
    assert type(sent["runtime_config"]["parameters"]["gate_margin"]) is float
    assert "pipeline_spec" not in sent  # the run links to the uploaded version instead

    (pipeline,) = fake.pipelines.values()
    (version,) = fake.versions.values()
    assert pipeline["name"] == NAME
    assert version["name"].startswith("sha256-")
    # the version it links to is also a parameter of its runs: the registry records it
    assert version_param == version["name"] == version_name(str(PIPELINE))
    assert run["pipeline_version_reference"] == {
        "pipeline_id": pipeline["pipeline_id"],
        "pipeline_version_id": version["pipeline_version_id"],
    }
    spec = yaml.safe_load_all(PIPELINE.read_text())
    assert version["pipeline_spec"]["pipeline_spec"] == next(spec)
    (experiment,) = fake.experiments.values()
    assert run["experiment_id"] == experiment["experiment_id"]
    # the list's key is the proto's own field name, as kfp_server_api's model reads it
    listed = requests.get(f"{fake.url}{API}/recurringruns", timeout=10).json()
    assert [r["recurring_run_id"] for r in listed["recurringRuns"]] == [run["recurring_run_id"]]
    assert f"created recurring run {NAME} ({run['recurring_run_id']})" in out
    assert "'0 0 2 * * *' (from '0 2 * * *')" in out
    assert f"{fake.url}/#/recurringrun/details/{run['recurring_run_id']}" in out


def test_schedule_again_updates_in_place_without_a_duplicate(
    fake: FakeKfp, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _schedule(fake, "--cron", "0 2 * * *", "--set", "train_steps=7") == 0
    (first,) = fake.recurring_runs
    assert _schedule(fake, "--cron", "30 4 * * 1-5", "--set", "train_steps=9") == 0
    out, _ = capsys.readouterr()
    assert fake.errors == []

    (run,) = fake.recurring_runs.values()  # exactly one, the new one
    assert run["recurring_run_id"] != first
    assert run["trigger"]["cron_schedule"]["cron"] == "0 30 4 * * 1-5"
    assert run["runtime_config"]["parameters"] == {
        "train_steps": 9,
        "pipeline_version": version_name(str(PIPELINE)),
    }
    assert f"updated recurring run {NAME} ({run['recurring_run_id']})" in out
    assert f"deleted the replaced recurring run {first}" in out
    # the same YAML: the pipeline and its version are reused, not uploaded again
    assert len(fake.pipelines) == 1 and len(fake.versions) == 1
    assert _posts(fake, "/pipelines/upload_version") == 1
    # created before the old one was deleted: never a moment without a schedule
    order = [
        (r.method, r.path)
        for r in fake.requests
        if (r.path == f"{API}/recurringruns" and r.method == "POST") or r.method == "DELETE"
    ]
    assert order == [
        ("POST", f"{API}/recurringruns"),
        ("POST", f"{API}/recurringruns"),
        ("DELETE", f"{API}/recurringruns/{first}"),
    ]


def test_schedule_with_the_same_settings_changes_nothing(
    fake: FakeKfp, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--cron", "0 2 * * *", "--set", "train_steps=7")
    assert _schedule(fake, *args) == 0
    (first,) = fake.recurring_runs
    assert _schedule(fake, *args) == 0
    out, _ = capsys.readouterr()
    assert list(fake.recurring_runs) == [first]
    assert _posts(fake, "/recurringruns") == 1
    assert f"unchanged recurring run {NAME} ({first})" in out


def test_a_changed_pipeline_is_a_new_version_the_schedule_links_to(
    fake: FakeKfp, tmp_path: Path
) -> None:
    assert _schedule(fake, "--cron", "0 2 * * *") == 0
    docs = list(yaml.safe_load_all(PIPELINE.read_text()))
    docs[0]["pipelineInfo"]["description"] = "retrained nightly"
    changed = tmp_path / "llm_train.yaml"
    changed.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    assert _schedule(fake, "--cron", "0 2 * * *", pipeline=changed) == 0
    assert fake.errors == []
    assert len(fake.pipelines) == 1
    assert len(fake.versions) == 2
    (run,) = fake.recurring_runs.values()
    version = fake.versions[run["pipeline_version_reference"]["pipeline_version_id"]]
    assert version["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["description"] == (
        "retrained nightly"
    )


def test_pause_resume_delete(fake: FakeKfp, capsys: pytest.CaptureFixture[str]) -> None:
    assert _schedule(fake, "--cron", "0 2 * * *") == 0
    (run_id,) = fake.recurring_runs

    assert _schedule(fake, "--pause", pipeline=None) == 0
    assert fake.recurring_runs[run_id]["mode"] == "DISABLE"
    assert fake.recurring_runs[run_id]["status"] == "DISABLED"
    assert _posts(fake, f"/recurringruns/{run_id}:disable") == 1

    # an update keeps a paused schedule paused
    assert _schedule(fake, "--cron", "0 3 * * *") == 0
    (run_id,) = fake.recurring_runs
    assert fake.recurring_runs[run_id]["mode"] == "DISABLE"

    assert _schedule(fake, "--resume", pipeline=None) == 0
    assert fake.recurring_runs[run_id]["mode"] == "ENABLE"
    assert _posts(fake, f"/recurringruns/{run_id}:enable") == 1

    assert _schedule(fake, "--delete", pipeline=None) == 0
    assert fake.recurring_runs == {}
    out, _ = capsys.readouterr()
    assert f"paused recurring run {NAME} (" in out
    for verb in ("resumed", "deleted"):
        assert f"{verb} recurring run {NAME} ({run_id})" in out
    assert fake.errors == []

    # nothing left to delete: one line, exit 2
    assert _schedule(fake, "--delete", pipeline=None) == 2
    _, err = capsys.readouterr()
    assert err.startswith(f"kubellm: error: no recurring run named '{NAME}'")
    assert err.count("\n") == 1


def test_list_is_a_table(fake: FakeKfp, capsys: pytest.CaptureFixture[str]) -> None:
    assert _schedule(fake, "--cron", "0 2 * * *") == 0
    assert _schedule(fake, "--cron", "@hourly", "--name", "hourly-eval") == 0
    assert _schedule(fake, "--pause", "--name", "hourly-eval", pipeline=None) == 0
    capsys.readouterr()
    assert _schedule(fake, "--list", pipeline=None) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "CRON", "STATE", "PIPELINE", "VERSION", "ID"]
    (version,) = fake.versions.values()
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {NAME, "hourly-eval"}
    assert "0 0 2 * * *" in rows[NAME] and "enabled" in rows[NAME]
    assert "@hourly" in rows["hourly-eval"] and "paused" in rows["hourly-eval"]
    for run_id, run in fake.recurring_runs.items():
        assert run_id in rows[run["display_name"]]
        assert version["name"] in rows[run["display_name"]]


def test_list_with_no_experiment_says_so(fake: FakeKfp, capsys: pytest.CaptureFixture[str]) -> None:
    assert _schedule(fake, "--list", pipeline=None) == 0
    out, _ = capsys.readouterr()
    assert out == f"no recurring runs in experiment kubellm at {fake.url}\n"
    assert fake.experiments == {}  # listing creates nothing


def test_schedule_converges_on_one_when_duplicates_exist(fake: FakeKfp) -> None:
    """Two recurring runs of one name (made by hand, or left by an interrupted update):
    the next schedule leaves exactly one."""
    assert _schedule(fake, "--cron", "0 2 * * *") == 0
    (run,) = fake.recurring_runs.values()
    body = {k: run[k] for k in run if k not in ("recurring_run_id", "created_at", "updated_at")}
    body.pop("status")
    assert requests.post(f"{fake.url}{API}/recurringruns", json=body, timeout=10).ok
    assert len(fake.recurring_runs) == 2
    assert _schedule(fake, "--cron", "0 2 * * *") == 0  # the settings of both: keep one
    assert len(fake.recurring_runs) == 1
    assert _schedule(fake, "--cron", "0 5 * * *") == 0
    (run,) = fake.recurring_runs.values()
    assert run["trigger"]["cron_schedule"]["cron"] == "0 0 5 * * *"
    assert fake.errors == []


def test_schedule_in_a_profile_namespace_with_a_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with FakeKfp(multi_user=True, token="s3cret") as fake:
        args = ("--namespace", "team-a", "--token-file", str(token))
        assert _schedule(fake, "--cron", "0 2 * * *", *args) == 0
        assert fake.errors == []
        (run,) = fake.recurring_runs.values()
        assert run["namespace"] == "team-a"
        (pipeline,) = fake.pipelines.values()
        assert pipeline["namespace"] == "team-a"


@pytest.mark.parametrize("how", ["--user", "--cookie-file"])
def test_schedule_signs_in_with_user_or_cookie_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """Every call (the upload, the recurring run, --list, --pause) carries the identity
    header (a port-forward) or the session cookie (through the gateway)."""
    user, session = "alice@example.com", "oauth2_proxy_kubeflow=c2Vzc2lvbg=="
    cookie = tmp_path / "cookie"
    cookie.write_text(session + "\n")
    cookie.chmod(0o600)
    sign_in = ("--user", user) if how == "--user" else ("--cookie-file", str(cookie))
    gateway = session if how == "--cookie-file" else None
    with FakeKfp(multi_user=True, user=user, session_cookie=gateway) as fake:
        args = ("--namespace", "team-a", *sign_in)
        assert _schedule(fake, "--cron", "0 2 * * *", *args) == 0
        assert _schedule(fake, "--list", *args, pipeline=None) == 0
        assert _schedule(fake, "--pause", *args) == 0
        assert fake.errors == []
        (run,) = fake.recurring_runs.values()
        assert run["mode"] == "DISABLE"
        header, value = ("kubeflow-userid", user) if how == "--user" else ("Cookie", session)
        assert fake.requests and all(r.header(header) == [value] for r in fake.requests)
        capsys.readouterr()

        assert _schedule(fake, "--list", "--namespace", "team-a", pipeline=None) == 2
        _, err = capsys.readouterr()
        assert "(401): " in err and how in err and err.count("\n") == 1, err


# -- validated before anything is sent ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--cron", "0 2 * *"], "--cron '0 2 * *': needs 5 fields"),
        (["--cron", "0 25 * * *"], "End of range (25) above maximum (23)"),
        (["--cron", "0 2 * * 7"], "End of range (7) above maximum (6)"),
        (["--cron", "@fortnightly"], "Unrecognized descriptor: @fortnightly"),
        (["--cron", "0 2 * * *", "--set", "train_steps=-1"], "train_steps"),
        (["--cron", "0 2 * * *", "--set", "nope=1"], "nope"),
        (["--cron", "0 2 * * *", "--max-concurrency", "11"], "--max-concurrency 11"),
        (["--set", "train_steps=7"], "--cron is required"),
        (["--pause", "--cron", "0 2 * * *"], "--pause takes no --cron"),
    ],
)
def test_bad_input_exits_2_and_sends_nothing(
    fake: FakeKfp, capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    assert _schedule(fake, *args) == 2
    out, err = capsys.readouterr()
    assert fake.requests == []
    assert err.startswith("kubellm: error: ")
    assert err.count("\n") == 1, err
    assert named in err
    assert out == ""


def test_missing_pipeline_file_is_one_line(
    fake: FakeKfp, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert _schedule(fake, "--cron", "0 2 * * *", pipeline=tmp_path / "none.yaml") == 2
    _, err = capsys.readouterr()
    assert "none.yaml" in err and err.count("\n") == 1
    assert fake.requests == []


def test_a_refused_update_keeps_the_old_schedule(
    fake: FakeKfp, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A YAML compiled without a parameter the CLI knows: the server refuses the new recurring
    run (400), a one-line error, and the schedule that was there stays."""
    assert _schedule(fake, "--cron", "0 2 * * *") == 0
    (kept,) = fake.recurring_runs
    docs = list(yaml.safe_load_all(PIPELINE.read_text()))
    del docs[0]["root"]["inputDefinitions"]["parameters"]["train_steps"]
    narrowed = tmp_path / "narrow.yaml"
    narrowed.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    capsys.readouterr()
    rc = _schedule(fake, "--cron", "0 3 * * *", "--set", "train_steps=7", pipeline=narrowed)
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith(f"kubellm: error: KFP at {fake.url} refused the recurring run (400): ")
    assert "train_steps: not an input parameter" in err
    assert err.count("\n") == 1, err
    assert out == ""
    assert list(fake.recurring_runs) == [kept]
    assert fake.recurring_runs[kept]["trigger"]["cron_schedule"]["cron"] == "0 0 2 * * *"


# -- cron, as KFP's robfig/cron v1.2.0 parses it --------------------------------------------


@pytest.mark.parametrize(
    ("written", "sent"),
    [
        ("0 2 * * *", "0 0 2 * * *"),
        ("  */15   *  * * mon-fri ", "0 */15 * * * mon-fri"),
        ("0 0 2 * * *", "0 0 2 * * *"),
        ("@daily", "@daily"),
        ("@every 6h", "@every 6h"),
        ("0 9 1 jan,jul ?", "0 0 9 1 jan,jul ?"),
    ],
)
def test_cron_as_sent(written: str, sent: str) -> None:
    assert kfp_cron(written) == sent


# robfig/cron v1.2.0 parser_test.go TestRange/TestParse expectations (`Parse`: seconds first)
ROBFIG_CASES = [
    ("* 5 * * * *", None),
    ("5 * * * *", None),  # 5 fields: second..month, day of week optional
    ("@every 5m", None),
    ("@yearly", None),
    ("@annually", None),
    ("0 0 0 1 1 0", None),
    ("*/2 5-7/2 1,5 * jan-dec sun-sat", None),
    ("* 5 j * * *", "Failed to parse int from j"),
    ("@every Xm", "Failed to parse duration"),
    ("@unrecognized", "Unrecognized descriptor"),
    ("* * * *", "Expected 5 to 6 fields, found 4"),
    ("", "Empty spec string"),
    ("5--5 * * * *", "Too many hyphens"),
    ("jan-x * * * *", "Failed to parse int from jan"),
    ("*/-12 * * * *", "Negative number"),
    ("*//2 * * * *", "Too many slashes"),
    ("0 0 0 0 * *", "below minimum (1)"),
    ("60 * * * *", "above maximum (59)"),
    ("5-3 * * * *", "beyond end of range"),
    ("*/0 * * * *", "should be a positive number"),
    ("0 0 0 * * 7", "End of range (7) above maximum (6)"),
]


@pytest.mark.parametrize(("spec", "error"), ROBFIG_CASES)
def test_cron_check_is_robfig_parse(spec: str, error: str | None) -> None:
    got = robfig_cron_error(spec)
    if error is None:
        assert got is None
    else:
        assert got is not None and error in got


# -- the fake's own checks (so a passing schedule test means something) --------------------


@dataclass
class Case:
    name: str
    change: dict[str, Any] = field(default_factory=dict)  # top-level fields of the body
    parameters: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    error: str = ""  # expected in the error message; empty: accepted


RR_CASES = [
    Case("valid"),
    Case("valid periodic", change={"trigger": {"periodic_schedule": {"interval_second": "60"}}}),
    Case("valid typed parameters", parameters={"train_steps": 7, "learning_rate": 1}),
    Case("unknown field", change={"schedule": "x"}, status=400, error="schedule: unknown field"),
    Case(
        "bad cron",
        change={"trigger": {"cron_schedule": {"cron": "0 2 * *"}}},
        status=400,
        error="Expected 5 to 6 fields, found 4",
    ),
    Case(
        "day of week 7",
        change={"trigger": {"cron_schedule": {"cron": "0 0 2 * * 7"}}},
        status=400,
        error="above maximum (6)",
    ),
    Case(
        "unknown cron field",
        change={"trigger": {"cron_schedule": {"cron": "@daily", "timezone": "UTC"}}},
        status=400,
        error="trigger.cron_schedule.timezone: unknown field",
    ),
    Case("no trigger", change={"trigger": None}, status=400, error="trigger: required"),
    Case(
        "zero interval",
        change={"trigger": {"periodic_schedule": {"interval_second": 0}}},
        status=400,
        error="invalid period schedule interval",
    ),
    Case(
        "unknown mode",
        change={"mode": "ON"},
        status=400,
        error='mode: invalid value for enum field mode: "ON"',
    ),
    Case(
        "no max_concurrency",
        change={"max_concurrency": None},
        status=400,
        error="Max concurrency of a recurring run must be at least 1",
    ),
    Case("max_concurrency 11", change={"max_concurrency": 11}, status=400, error="at most 10"),
    Case("no name", change={"display_name": ""}, status=400, error="name cannot be empty"),
    Case(
        "unknown experiment",
        change={"experiment_id": "nope"},
        status=404,
        error="Experiment nope not found",
    ),
    Case(
        "missing version",
        change={"pipeline_version_reference": {"pipeline_id": "p", "pipeline_version_id": "v"}},
        status=404,
        error="version v of pipeline p not found",
    ),
    Case(
        "undeclared parameter",
        parameters={"nope": 1},
        status=400,
        error="runtime_config.parameters.nope: not an input parameter",
    ),
    Case(
        "fraction for an integer",
        parameters={"train_steps": 7.5},
        status=400,
        error="train_steps: NUMBER_INTEGER needs an integer",
    ),
]


def _upload(fake: FakeKfp, name: str = NAME) -> requests.Response:
    return requests.post(
        f"{fake.url}{API}/pipelines/upload",
        params={"name": name},
        files={"uploadfile": ("llm_train.yaml", PIPELINE.read_bytes())},
        timeout=10,
    )


def _recurring_run_body(fake: FakeKfp) -> dict[str, Any]:
    """A nightly recurring run of the uploaded pipeline's version, in a new experiment, with
    no mode and no parameters."""
    experiment = fake.add_experiment("direct")
    pipeline = _upload(fake).json()
    (version,) = fake.versions.values()
    return {
        "display_name": "nightly",
        "experiment_id": experiment["experiment_id"],
        "max_concurrency": "1",
        "trigger": {"cron_schedule": {"cron": "0 0 2 * * *"}},
        "pipeline_version_reference": {
            "pipeline_id": pipeline["pipeline_id"],
            "pipeline_version_id": version["pipeline_version_id"],
        },
    }


@pytest.mark.parametrize("case", RR_CASES, ids=[c.name for c in RR_CASES])
def test_fake_checks_recurring_run_creates(fake: FakeKfp, case: Case) -> None:
    body = _recurring_run_body(fake)
    body.update(mode="ENABLE", runtime_config={"parameters": case.parameters})
    body.update(copy.deepcopy(case.change))
    body = {k: v for k, v in body.items() if v is not None}
    resp = requests.post(f"{fake.url}{API}/recurringruns", json=body, timeout=10)
    assert resp.status_code == case.status, resp.text
    if not case.error:
        assert resp.json()["recurring_run_id"] in fake.recurring_runs
        assert resp.json()["status"] == "ENABLED"
        assert fake.errors == []
        return
    assert case.error in resp.json()["message"]
    assert resp.json()["code"] in (3, 5)
    assert fake.recurring_runs == {}
    assert any(case.error in e for e in fake.errors)


@pytest.mark.parametrize(
    ("mode", "status"),
    [
        ("ENABLE", "ENABLED"),
        ("DISABLE", "DISABLED"),
        ("MODE_UNSPECIFIED", "DISABLED"),  # toModelJobEnabled: unspecified is disabled
        (None, "DISABLED"),  # no mode: the enum's zero value
        (1, "ENABLED"),  # protojson reads an enum's number too
    ],
)
def test_fake_recurring_run_mode_is_the_servers(fake: FakeKfp, mode: Any, status: str) -> None:
    body = _recurring_run_body(fake)
    if mode is not None:
        body["mode"] = mode
    resp = requests.post(f"{fake.url}{API}/recurringruns", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    assert (resp.json()["status"], resp.json()["mode"]) == (status, status[:-1])
    assert fake.errors == []
    # a number the enum lacks passes the decode and fails toModelJobEnabled: internal
    body["mode"] = 7
    resp = requests.post(f"{fake.url}{API}/recurringruns", json=body, timeout=10)
    assert resp.status_code == 500 and "Recurring run's mode is invalid: 7" in resp.text


def test_fake_upload_rules(fake: FakeKfp) -> None:
    first = _upload(fake)
    assert first.status_code == 200 and first.json()["name"] == NAME
    # the (namespace, name) unique index: 409 with the upload handler's error body
    again = _upload(fake)
    assert again.status_code == 409
    assert again.json()["error_message"] == "Failed to create a pipeline and a pipeline version"
    pid = first.json()["pipeline_id"]

    def version(name: str, pipeline_id: str = pid, content: bytes | None = None) -> Any:
        return requests.post(
            f"{fake.url}{API}/pipelines/upload_version",
            params={"name": name, "pipelineid": pipeline_id},
            files={"uploadfile": ("p.yaml", content or PIPELINE.read_bytes())},
            timeout=10,
        )

    assert version("v2").status_code == 200
    assert version("v2").status_code == 409  # (pipeline, name) unique
    assert version("v3", pipeline_id="nope").status_code == 400
    bad = version("v4", content=b"pipelineInfo: {name: x}\n")
    assert bad.status_code == 400
    assert "deploymentSpec.executors: required" in bad.json()["error_message"]
    listed = requests.get(f"{fake.url}{API}/pipelines/{pid}/versions", timeout=10).json()
    assert sorted(v["name"] for v in listed["pipeline_versions"]) == [NAME, "v2"]


def test_fake_recurring_run_calls_on_a_missing_id_are_404(fake: FakeKfp) -> None:
    for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", ":enable"), ("POST", ":disable")):
        resp = requests.request(method, f"{fake.url}{API}/recurringruns/nope{suffix}", timeout=10)
        assert resp.status_code == 404, (method, suffix)
        assert resp.json()["code"] == 5


def test_fake_wants_the_bearer_token() -> None:
    with FakeKfp(token="s3cret") as fake:
        assert requests.get(f"{fake.url}{API}/healthz", timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (
            requests.get(f"{fake.url}{API}/healthz", headers=wrong, timeout=10).status_code == 401
        )
        right = {"Authorization": "Bearer s3cret"}
        assert requests.get(f"{fake.url}{API}/healthz", headers=right, timeout=10).ok
        assert len(fake.errors) == 2


# -- the backend version ------------------------------------------------------------------

NEEDS = "kubellm needs KFP backend 2.16 or newer (2.17 recommended; README 'Supported versions')"


def test_schedule_refuses_an_older_backend_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeKfp(tag_name="2.5.0") as fake:
        rc = _schedule(fake, "--cron", "0 2 * * *", "--set", "train_steps=7")
        out, err = capsys.readouterr()
        assert rc == 2
        assert err == f"kubellm: error: KFP at {fake.url} runs backend 2.5.0; {NEEDS}\n"
        assert out == ""
        # nothing uploaded, no experiment, no recurring run: only the question was asked
        assert fake.recurring_runs == {} and fake.pipelines == {} and fake.experiments == {}
        assert [(r.method, r.path) for r in fake.requests] == [("GET", f"{API}/healthz")]


def test_schedule_proceeds_on_2_17(fake: FakeKfp) -> None:
    assert fake.tag_name == "2.17.0"  # the fake announces what the recommended release does
    assert _schedule(fake, "--cron", "0 2 * * *") == 0
    assert fake.errors == [] and len(fake.recurring_runs) == 1
    assert (fake.requests[0].method, fake.requests[0].path) == ("GET", f"{API}/healthz")


def test_schedule_on_a_backend_that_does_not_say_needs_skip_version_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with FakeKfp(tag_name="unknown") as fake:
        assert _schedule(fake, "--cron", "0 2 * * *") == 2
        _, err = capsys.readouterr()
        assert "does not announce its backend version" in err and NEEDS in err
        assert "--skip-version-check" in err and err.count("\n") == 1, err
        assert fake.recurring_runs == {}
        assert _schedule(fake, "--cron", "0 2 * * *", "--skip-version-check") == 0
        assert fake.errors == [] and len(fake.recurring_runs) == 1


def test_list_pause_delete_work_on_an_old_backend_resume_does_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Running nothing, they help leave an old backend; resuming starts runs again."""
    with FakeKfp() as fake:
        assert _schedule(fake, "--cron", "0 2 * * *") == 0
        fake.tag_name = "2.5.0"
        assert _schedule(fake, "--list", pipeline=None) == 0
        assert _schedule(fake, "--pause") == 0
        capsys.readouterr()
        assert _schedule(fake, "--resume") == 2
        _, err = capsys.readouterr()
        assert err == f"kubellm: error: KFP at {fake.url} runs backend 2.5.0; {NEEDS}\n"
        (run,) = fake.recurring_runs.values()
        assert run["mode"] == "DISABLE"  # still paused
        assert _schedule(fake, "--delete") == 0
        assert fake.recurring_runs == {}
