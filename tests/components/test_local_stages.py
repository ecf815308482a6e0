"""kubellm.commands.local_stages: one component, or a span of the stages, under kfp.local on
inputs a user gives (`run_component`, `run_stages`, `kubellm run --local --from/--to`), and
the README's example of a user's own pytest of a changed component, run as written.

The runs are the cheap stages (prepare_data, record_data) on a small JSONL the test writes;
each kfp.local span also runs preflight and the summary, as every run does.
"""

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kfp import dsl

from kubellm.cli import main
from kubellm.commands import local_stages
from kubellm.commands.local_stages import SOURCES, STAGE_INPUTS, STAGES, plan, run_stages
from kubellm.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MARKER = "<!-- test: component-example -->"


def _rows(n: int = 200) -> list[dict[str, str]]:
    return [{"text": f"the sum of {i} and {i + 3} is {2 * i + 3}"} for i in range(n)]


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# -- the stage table against the components and the compiled DAG (fast) -----------------


def _producer(ref: dict[str, Any], tasks: set[str]) -> tuple[str, str] | None:
    """(producer task, its output) of one task input of the compiled YAML, or None when it
    is a pipeline parameter."""
    for kind in ("taskOutputArtifact", "taskOutputParameter"):
        if kind in ref:
            key = ref[kind].get("outputArtifactKey") or ref[kind]["outputParameterKey"]
            return ref[kind]["producerTask"], key
    channel = ref.get("componentInputArtifact") or ref.get("componentInputParameter") or ""
    name = channel.removeprefix("pipelinechannel--")
    for task in sorted(tasks, key=len, reverse=True):
        if name.startswith(f"{task}-"):
            return task, name[len(task) + 1 :]
    return None


def test_the_stage_table_is_the_components_and_the_dag() -> None:
    spec = next(yaml.safe_load_all((REPO / "pipelines/llm_train.yaml").read_text()))
    dags = [spec["root"], *spec["components"].values()]
    tasks = {name: t for d in dags for name, t in d.get("dag", {}).get("tasks", {}).items()}
    wired: dict[str, dict[str, tuple[str, str]]] = {}
    for stage in STAGES:
        task = tasks[stage.replace("_", "-")]
        refs = {**task["inputs"].get("artifacts", {}), **task["inputs"].get("parameters", {})}
        wired[stage] = {
            name: (producer[0].replace("-", "_"), producer[1])
            for name, ref in refs.items()
            if (producer := _producer(ref, set(tasks))) and producer[0] != "preflight"
        }
        component = local_stages._component(stage)
        context = {"data_spec"} if stage == "prepare_data" else {*local_stages._CONTEXT}
        assert set(component.component_spec.inputs) == {*STAGE_INPUTS[stage], *context}, stage
    table = {
        stage: {name: (SOURCES[name].stage, SOURCES[name].output) for name in STAGE_INPUTS[stage]}
        for stage in STAGES
    }
    assert table == wired
    for name, source in SOURCES.items():  # an artifact input is imported as its declared class
        declared = local_stages._component(source.stage).component_spec.outputs[source.output]
        expected = getattr(dsl, source.artifact).schema_title if source.artifact else "String"
        assert declared.type.partition("@")[0] == expected, name


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def evaluate(
    config: str,
    parent_run_id: str,
    kfp_run_id: str,
    model: dsl.Input[dsl.Model],
    dataset: dsl.Input[dsl.Dataset],
    metrics: dsl.Output[dsl.Metrics],
    predictions: dsl.Output[dsl.Dataset],
    report: dsl.Output[dsl.Markdown],
    html_report: dsl.Output[dsl.HTML],
) -> str:
    """A user's own evaluate (the same inputs and outputs as the stage's)."""
    return "promote-by-my-evaluate"


def test_a_span_is_the_dags_wiring_and_conditions(tmp_path: Path) -> None:
    """Compiled, not run: preflight, the given inputs imported, the stages, the gate around
    what follows evaluate, the summary as exit handler; a replaced component runs instead."""
    from kfp import compiler

    span = plan("evaluate", None, {"model": str(tmp_path), "dataset": str(tmp_path)})
    values = local_stages.pipeline_config(platform="local").model_dump()
    pipeline = local_stages._pipeline("t-span", span, values, {"evaluate": evaluate})
    compiler.Compiler().compile(pipeline, str(tmp_path / "span.yaml"))
    spec = next(yaml.safe_load_all((tmp_path / "span.yaml").read_text()))
    dags = {"root": spec["root"], **spec["components"]}
    tasks = {name: set(d.get("dag", {}).get("tasks", {})) for name, d in dags.items()}
    assert tasks["root"] == {"exit-handler-1", "summarize"}
    assert tasks["comp-exit-handler-1"] == {
        "preflight",
        "importer",
        "importer-2",
        "evaluate",
        "condition-2",
    }
    assert tasks["comp-condition-2"] == {"register", "deploy", "smoke-test"}
    gate = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["condition-2"]
    assert "'promote'" in gate["triggerPolicy"]["condition"]
    imported = {
        t["inputs"]["parameters"]["uri"]["runtimeValue"]["constant"]
        for name, t in spec["components"]["comp-exit-handler-1"]["dag"]["tasks"].items()
        if name.startswith("importer")
    }
    assert imported == {str(tmp_path.resolve())}
    executor = json.dumps(spec["deploymentSpec"]["executors"]["exec-evaluate"])
    assert "promote-by-my-evaluate" in executor


# -- errors, before anything runs (fast) ---------------------------------------------------


@dataclass
class ErrorCase:
    name: str
    start: str
    stop: str | None
    inputs: dict[str, str]
    match: str


ERRORS = [
    ErrorCase("unknown stage", "prepare", None, {}, r"unknown stage 'prepare': one of prep"),
    ErrorCase("preflight", "preflight", None, {}, r"preflight starts every span"),
    ErrorCase("reversed", "evaluate", "train", {}, r"'train' comes before 'evaluate'"),
    ErrorCase(
        "missing input",
        "evaluate",
        "evaluate",
        {"dataset": "."},
        r"evaluate needs input 'model' \(train's model, and train is not in the span "
        r"evaluate\): give a Model path as --input model=\.\.\., or start the span at train",
    ),
    ErrorCase(
        "made inside",
        "prepare_data",
        "tune",
        {"dataset": "."},
        r"input 'dataset' is made by prepare_data, which is in the span prepare_data\.\.tune",
    ),
    ErrorCase(
        "unknown input",
        "register",
        "register",
        {"modle": "."},
        r"unknown input 'modle' for the span register; the inputs it takes: model",
    ),
    ErrorCase(
        "missing path",
        "tune",
        "tune",
        {"dataset": "no/such/dir"},
        r"input dataset=no/such/dir: no such file or directory",
    ),
    ErrorCase(
        "missing value",
        "smoke_test",
        None,
        {"predictions": ".", "version": "1"},
        r"smoke_test needs input 'endpoint' \(deploy's Output.*give its value",
    ),
]


@pytest.mark.parametrize("case", ERRORS, ids=lambda c: c.name)
def test_a_bad_span_fails_before_anything_runs(case: ErrorCase) -> None:
    with pytest.raises(ConfigError, match=case.match):
        plan(case.start, case.stop, case.inputs)


def test_a_span_takes_only_what_it_needs(tmp_path: Path) -> None:
    span = plan("train", "evaluate", {"dataset": str(tmp_path)})  # hparams: optional
    assert span.stages == ("train", "evaluate")
    assert span.inputs == {"dataset": str(tmp_path.resolve())}
    assert set(span.needs()) == {"dataset", "hparams"}
    assert plan("deploy", inputs={"model": ".", "predictions": ".", "version": "3"}).stages == (
        "deploy",
        "smoke_test",
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--from", "evaluate", "--to", "evaluate"], "evaluate needs input 'model'"),
        (["--from", "train", "--input", "dataset"], "--input 'dataset': expected NAME=PATH"),
        (["--input", "dataset=x"], "--input needs --from or --to"),
        (["--to", "nope"], "unknown stage 'nope'"),
    ],
    ids=["missing-input", "bad-input", "input-without-span", "unknown-stage"],
)
def test_the_cli_says_what_is_wrong_and_runs_nothing(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    assert main(["run", "--local", *argv, "--set", f"runs_dir={runs}"]) == 2
    assert said in capsys.readouterr().err
    assert not runs.exists()


def test_without_components_it_says_where_to_run_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # not a clone's root, and components/ not importable
    monkeypatch.setattr(local_stages.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs kubellm's components/ package .* root"):
        local_stages.check_components()


# -- real runs under kfp.local (slow) ------------------------------------------------------


@pytest.fixture(scope="module")
def span(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[local_stages.LocalRun, Path]]:
    tmp = tmp_path_factory.mktemp("span")
    rows = _rows()
    source = _write_jsonl(tmp / "data.jsonl", [*rows, rows[0]])
    runs = tmp / "runs"
    done = run_stages(
        "prepare_data",
        "record_data",
        runs_dir=str(runs),
        data_source=str(source),
        vocab_size=300,
        seq_len=16,
        model_name="local-stages-test",
    )
    yield done, runs


@pytest.mark.slow
def test_run_stages_runs_the_span_and_returns_its_outputs(span: Any) -> None:
    done, runs = span
    assert set(done.stages) == {"preflight", "prepare_data", "record_data"}
    data = done["prepare_data"]
    assert isinstance(data.outputs["dataset"], dsl.Dataset)
    assert isinstance(data.outputs["stats"], dsl.Metrics)
    root = Path(data.outputs["dataset"].path)
    assert root.is_relative_to(runs / "kfp")
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["records"]["read"] == 201 and manifest["records"]["dropped"]["duplicate"] == 1
    assert manifest["params"]["vocab_size"] == 300  # what was given; the rest the pipeline's
    assert (root / "train" / "shard-00000.parquet").is_file()
    assert data.outputs["dataset"].metadata["data_fingerprint"] == manifest["data_fingerprint"]
    assert done["record_data"].output == "changed"  # no champion in this MLflow store
    config = json.loads(done["preflight"].outputs["config"])
    assert config["platform"] == "local" and config["runs_dir"] == str(runs)
    assert config["train_steps"] == local_stages.pipeline_config().train_steps
    assert done.summary.startswith("# kubellm run ") and ": SUCCEEDED" in done.summary


@pytest.mark.slow
def test_kubellm_run_local_from_to_feeds_a_given_dataset(
    span: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done, runs = span
    dataset = done["prepare_data"].outputs["dataset"].path
    argv = ["run", "--local", "--from", "record_data", "--to", "record_data"]
    argv += ["--input", f"dataset={dataset}", "--set", f"runs_dir={runs}"]
    argv += ["--set", "model_name=local-stages-test"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "running stages record_data..record_data of components/ locally" in out
    assert "kubellm: record_data done" in out and "kubellm: prepare_data" not in out
    assert "pipeline succeeded" in out
    [run_dir] = sorted((runs / "kfp").glob("kubellm-record-data-record-data-*"))
    record = json.loads((run_dir / "record-data" / "executor_output.json").read_text())
    assert record["parameterValues"]["Output"] == "changed"
    [log] = re.findall(r"full log: (\S+)", out)[-1:]
    text = Path(log).read_text()
    assert "importer" in text and f"{dataset}" in text  # the given dataset, imported


def readme_example() -> str:
    """The fenced Python block right after the README's marker line."""
    text = README.read_text()
    assert MARKER in text, f"README.md lost its {MARKER} line"
    found = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.DOTALL)
    assert found, f"no ```python block right after {MARKER}"
    return found.group(1) + "\n"


@pytest.mark.slow
def test_the_readme_component_example_runs_as_written(tmp_path: Path) -> None:
    example = tmp_path / "test_readme_example.py"
    example.write_text(readme_example())
    env = dict(os.environ)  # kubellm and components/ as in this checkout
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    )
    # as a user runs their own test in their clone: its pytest config, its root
    cmd = [sys.executable, "-m", "pytest", str(example), "-q", "-p", "no:cacheprovider"]
    cmd += ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr
