"""One component, or the stages from one to another, under kfp.local on inputs you give.

The span is a pipeline built here from the components' Python source (components/*.py, so
a changed component runs without `kubellm compile`): preflight (it validates the parameters
and opens the run's MLflow lineage, as every run does), the stages from `start` to `stop` in
DAG order with the DAG's own wiring and conditions, and the summary as its exit handler.
An artifact input of the span's first stages that an earlier stage would have made comes
from a path you give, through `dsl.importer`; the parameters default to the pipeline's
(kubellm.config.PipelineConfig), so you give only what you change.

    kubellm run --local --from evaluate --input model=runs/model --input dataset=runs/dataset

From Python (a test of a changed component, README "Testing a changed component locally"):

    from kubellm.commands.local_stages import run_component
    out = run_component("evaluate", {"model": "runs/model", "dataset": "runs/dataset"},
                        runs_dir="/tmp/runs")
    out.output, out.outputs["metrics"].metadata["perplexity"]
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubellm.config import ConfigError, pipeline_config

# The stages a span may start and stop at, in DAG order (preflight starts every span; the
# summary is its exit handler).
from kubellm.stages import DAG as STAGES


@dataclass(frozen=True)
class Source:
    """Where one stage input comes from in the DAG: an output of an earlier stage."""

    stage: str
    output: str
    artifact: str = ""  # the KFP artifact class's name (Dataset, Model); "" for a parameter
    default: str | None = None  # a parameter the stage runs without: this value


# Every input a stage takes from another stage, by the input's name (one name, one source:
# `dataset` is prepare_data's dataset wherever it is used). tests/components checks this
# against the components' signatures and the compiled pipelines/llm_train.yaml's wiring.
SOURCES: dict[str, Source] = {
    "dataset": Source("prepare_data", "dataset", "Dataset"),
    "hparams": Source("tune", "Output", default=""),  # no tuning: the recipe's values
    "model": Source("train", "model", "Model"),
    "predictions": Source("evaluate", "predictions", "Dataset"),
    "version": Source("register", "Output"),
    "endpoint": Source("deploy", "Output"),
}
# The steps that change the world run every time, as in the pipeline.
_NO_CACHE = frozenset({"record_data", "register", "deploy", "smoke_test", "summarize"})
# What the context parameters of every stage but prepare_data are (preflight's outputs).
_CONTEXT = ("config", "parent_run_id", "kfp_run_id")


@dataclass
class StageOutputs:
    """A stage's outputs as kfp.local wrote them: its artifacts (dsl.Dataset, dsl.Model,
    dsl.Metrics, ...: `.path`, `.metadata`) and its output parameters, by output name."""

    stage: str
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def output(self) -> Any:
        """The component's return value (`Output`), None for a component without one."""
        return self.outputs.get("Output")


@dataclass
class LocalRun:
    """What a span run left: its kfp.local run directory, each stage's outputs (preflight's
    too; a stage a condition skipped is absent) and the summary report."""

    run_dir: Path
    stages: dict[str, StageOutputs]
    summary: str

    def __getitem__(self, stage: str) -> StageOutputs:
        return self.stages[stage]


@dataclass(frozen=True)
class Span:
    """A validated span: its stages and the inputs it is given (artifacts as absolute paths)."""

    stages: tuple[str, ...]
    inputs: dict[str, str]

    def needs(self) -> dict[str, Source]:
        """The inputs the span takes from outside: each stage's sources outside the span."""
        out: dict[str, Source] = {}
        for stage in self.stages:
            for name in STAGE_INPUTS[stage]:
                if SOURCES[name].stage not in self.stages:
                    out.setdefault(name, SOURCES[name])
        return out


# Which inputs of SOURCES each stage takes (the components' signatures).
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "prepare_data": (),
    "record_data": ("dataset",),
    "tune": ("dataset",),
    "train": ("dataset", "hparams"),
    "evaluate": ("model", "dataset"),
    "register": ("model",),
    "deploy": ("model", "version"),
    "smoke_test": ("endpoint", "predictions", "version"),
}


def plan(start: str, stop: str | None = None, inputs: Mapping[str, Any] | None = None) -> Span:
    """The span from `start` to `stop` (default: the last stage), checked before anything
    runs: known stages in order, every input it needs given, none it makes itself, every
    artifact path there."""
    for name in (start, stop):
        if name is not None and name not in STAGES:
            where = (
                "; preflight starts every span and the summary ends it"
                if name in ("preflight", "summarize")
                else ""
            )
            raise ConfigError(f"unknown stage {name!r}: one of {', '.join(STAGES)}{where}")
    first, last = STAGES.index(start), STAGES.index(stop or STAGES[-1])
    if last < first:
        raise ConfigError(f"stage {stop!r} comes before {start!r} in the pipeline")
    span = Span(STAGES[first : last + 1], {})
    needs = span.needs()
    given = {k: str(v) for k, v in (inputs or {}).items()}
    for name in given:
        if name in needs:
            continue
        if name in SOURCES and SOURCES[name].stage in span.stages:
            raise ConfigError(
                f"input {name!r} is made by {SOURCES[name].stage}, which is in "
                f"{_span_text(span)}: drop it, or start the span after {SOURCES[name].stage}"
            )
        takes = ", ".join(needs) or "none"
        raise ConfigError(
            f"unknown input {name!r} for {_span_text(span)}; the inputs it takes: {takes}"
        )
    resolved: dict[str, str] = {}
    for name, source in needs.items():
        if name not in given:
            if source.default is not None:
                continue
            users = [s for s in span.stages if name in STAGE_INPUTS[s]]
            what = f"a {source.artifact} path" if source.artifact else "its value"
            raise ConfigError(
                f"{users[0]} needs input {name!r} ({source.stage}'s {source.output}, and "
                f"{source.stage} is not in {_span_text(span)}): give {what} as "
                f"--input {name}=..., or start the span at {source.stage}"
            )
        value = given[name]
        if source.artifact:
            path = Path(value).expanduser().resolve()
            if not path.exists():
                raise ConfigError(f"input {name}={value}: no such file or directory")
            value = str(path)
        resolved[name] = value
    return Span(span.stages, resolved)


def run_stages(
    start: str,
    stop: str | None = None,
    inputs: Mapping[str, Any] | None = None,
    *,
    components: Mapping[str, Any] | None = None,
    **params: Any,
) -> LocalRun:
    """Run the stages `start`..`stop` under kfp.local (SubprocessRunner, this environment)
    and return their outputs; a failed task raises RuntimeError (kfp.local's, naming it).

    `inputs`: what the span needs from stages outside it (a path for an artifact, a value
    for a parameter). `params`: pipeline parameters (PipelineConfig fields); the rest are
    the pipeline's defaults, `platform` is local, runs_dir holds MLflow and kfp.local's
    outputs (`<runs_dir>/kfp`). `components`: a component to run instead of a stage's own,
    by stage name (the same inputs and outputs).
    """
    span = plan(start, stop, inputs)
    cfg = pipeline_config(params, platform="local")
    root = Path(cfg.runs_dir).resolve() / "kfp"
    root.mkdir(parents=True, exist_ok=True)
    values = {**cfg.model_dump(), "runs_dir": str(root.parent)}
    name = f"kubellm-{span.stages[0]}-{span.stages[-1]}-{time.strftime('%H%M%S')}"
    name = f"{name}-{next(_COUNTER)}".replace("_", "-")
    with _kfp_local(root, raise_on_error=True):
        _pipeline(name, span, values, components or {})()
    return outputs(root, name, components)


def run_component(
    component: Any, inputs: Mapping[str, Any] | None = None, **params: Any
) -> StageOutputs:
    """Run one stage's component under kfp.local on `inputs` (see run_stages) and return
    its outputs. `component`: the stage's name, or a component (`@dsl.component`) to run in
    its place, named as the stage it replaces."""
    if isinstance(component, str):
        stage, replacement = component, {}
    else:
        stage = str(getattr(component, "name", "")).replace("-", "_")
        replacement = {stage: component}
    return run_stages(stage, stage, inputs, components=replacement, **params)[stage]


def outputs(root: Path, name: str, components: Mapping[str, Any] | None = None) -> LocalRun:
    """The outputs of the span run `name` under the kfp.local pipeline root `root`, each
    artifact as the class its component declares (`components`: replaced stages')."""
    from kfp import dsl

    classes = {c.schema_title: c for c in vars(dsl).values() if hasattr(c, "schema_title")}
    [run_dir] = sorted(root.glob(f"{name}-*"))
    stages: dict[str, StageOutputs] = {}
    for path in sorted(run_dir.glob("*/executor_output.json")):
        stage = path.parent.name.replace("-", "_")
        if stage not in (*STAGES, "preflight"):
            continue  # importers, summarize
        declared = ((components or {}).get(stage) or _component(stage)).component_spec.outputs
        executor = json.loads(path.read_text())
        found = StageOutputs(stage, dict(executor.get("parameterValues", {})))
        for key, entry in executor.get("artifacts", {}).items():
            art = entry["artifacts"][0]
            title = str(declared[key].type).partition("@")[0] if key in declared else ""
            cls = classes.get(title, dsl.Artifact)
            found.outputs[key] = cls(uri=art["uri"], metadata=art.get("metadata", {}))
        stages[stage] = found
    summaries = sorted(run_dir.glob("summarize*/report"))
    return LocalRun(run_dir, stages, summaries[0].read_text() if summaries else "")


_COUNTER = itertools.count()


def _span_text(span: Span) -> str:
    first, last = span.stages[0], span.stages[-1]
    return f"the span {first}" if first == last else f"the span {first}..{last}"


_NO_COMPONENTS = (
    "running stages locally needs kubellm's components/ package (components/*.py of the "
    "repository): run it from the repository's root"
)


def check_components() -> None:
    """Fail in one line, before a run starts, where components/ cannot be imported."""
    if importlib.util.find_spec("components") is None and not (Path.cwd() / "components").is_dir():
        raise ConfigError(_NO_COMPONENTS)


def _component(stage: str) -> Any:
    """The stage's component from the repository's components/ (its Python source)."""
    try:
        return getattr(importlib.import_module(f"components.{stage}"), stage)
    except ModuleNotFoundError as err:
        if err.name != "components" or not (Path.cwd() / "components").is_dir():
            raise ConfigError(_NO_COMPONENTS) from err
    sys.path.insert(0, str(Path.cwd()))
    return getattr(importlib.import_module(f"components.{stage}"), stage)


@contextlib.contextmanager
def _kfp_local(root: Path, raise_on_error: bool) -> Iterator[None]:
    """kfp.local's SubprocessRunner in this environment, its previous config (a caller's
    own kfp.local.init) and PATH restored after."""
    from kfp import local

    saved, path = local.config.LocalExecutionConfig.instance, os.environ.get("PATH", "")
    # component subprocesses run `python3 ...`: make it this environment's python
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    local.config.LocalExecutionConfig.instance = None
    try:
        local.init(
            runner=local.SubprocessRunner(use_venv=False),
            pipeline_root=str(root),
            raise_on_error=raise_on_error,
        )
        yield
    finally:
        local.config.LocalExecutionConfig.instance = saved
        os.environ["PATH"] = path


def _pipeline(name: str, span: Span, values: dict[str, Any], replaced: Mapping[str, Any]) -> Any:
    """The span as a KFP pipeline: preflight, the stages, the summary as exit handler."""
    import warnings

    from kfp import dsl

    from kubellm.evaluate.gate import PROMOTE  # (kubellm.stages.evaluate imports torch)
    from kubellm.stages.prepare_data import CHANGED

    warnings.filterwarnings("ignore", message=".*non-Python base image.*")
    comps = {s: replaced.get(s) or _component(s) for s in ("preflight", "summarize", *span.stages)}
    # each as the pipeline passes them: its parameters by name (kfp_run_id, status aside)
    pre_params, summary_params = (
        {k: values[k] for k in comps[c].component_spec.inputs if k in values}
        for c in ("preflight", "summarize")
    )

    def span_pipeline():  # no annotations: KFP reads them
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        report = comps["summarize"](**summary_params, kfp_run_id=run_id)
        report.set_caching_options(False)
        with dsl.ExitHandler(report, name="run"):
            pre = comps["preflight"](**pre_params, kfp_run_id=run_id)
            ctx = {
                "config": pre.outputs["config"],
                "parent_run_id": pre.outputs["parent_run_id"],
                "kfp_run_id": run_id,
            }
            made: dict[str, Any] = {}
            for key, value in span.inputs.items():
                source = SOURCES[key]
                if source.artifact:
                    cls = getattr(dsl, source.artifact)
                    value = dsl.importer(artifact_uri=value, artifact_class=cls, reimport=True)
                    value = value.output
                made[key] = value
            with contextlib.ExitStack() as conditions:
                for stage in span.stages:
                    args = {k: made[k] for k in STAGE_INPUTS[stage] if k in made}
                    for k in STAGE_INPUTS[stage]:
                        if k not in made and SOURCES[k].default is not None:
                            args[k] = SOURCES[k].default
                    if stage == "prepare_data":
                        args["data_spec"] = pre.outputs["data_spec"]
                    else:
                        args.update(ctx)
                    task = comps[stage](**args)
                    if stage in _NO_CACHE:
                        task.set_caching_options(False)
                    for key, source in SOURCES.items():
                        if source.stage == stage:
                            made[key] = task.outputs[source.output]
                    more = stage != span.stages[-1]
                    if stage == "record_data" and more:  # nothing new: the run stops
                        conditions.enter_context(
                            dsl.If(task.output == CHANGED, name="data-changed")
                        )
                    if stage == "evaluate" and more:
                        conditions.enter_context(
                            dsl.If(task.outputs["Output"] == PROMOTE, name="gate")
                        )

    return dsl.pipeline(name=name)(span_pipeline)


def _execute(root: str, spec: dict[str, Any]) -> None:
    """The child of `kubellm run --local --from/--to` (local_run.run_local): the span under
    kfp.local, every task's output to its log file."""
    span = plan(spec["start"], spec["stop"], spec["inputs"])
    cfg = pipeline_config(spec["arguments"], platform="local")
    values = {**cfg.model_dump(), "runs_dir": str(Path(root).parent)}
    with _kfp_local(Path(root), raise_on_error=False):
        _pipeline(spec["name"], span, values, {})()


if __name__ == "__main__":
    _execute(sys.argv[1], json.loads(sys.argv[2]))
