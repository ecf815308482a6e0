"""What every pipeline stage starts from and gives back.

Components pass three strings (the config preflight validated, the parent MLflow run, the
KFP run id); `StageContext.load` turns them back into objects. Each stage returns a
`StageResult`: its KFP metrics, its Markdown report and a one-line headline, so a
component body only calls the stage and hands the result to its output artifacts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kubellm.backends import Backends, select
from kubellm.backends.base import TrainJob, dns_name
from kubellm.config import PipelineConfig, TrainConfig
from kubellm.process import end_kfp_step_fast
from kubellm.redact import redact
from kubellm.tracking import TAG_STAGE, Tracker, check_reachable

_R = TypeVar("_R", bound="StageResult")


class MetricsSink(Protocol):
    """What a KFP `Output[Metrics]` offers."""

    def log_metric(self, metric: str, value: float) -> None: ...


class ReportFile(Protocol):
    """What a KFP `Output[Markdown]` or `Output[HTML]` offers."""

    @property
    def path(self) -> str: ...


@dataclass
class StageResult:
    """What every stage returns: metrics (KFP Metrics and MLflow), a Markdown report, and a
    headline: the one line a person sees when the stage ends."""

    metrics: dict[str, float] = field(default_factory=dict)
    report: str = ""
    headline: str = ""

    def write_outputs(
        self, metrics: MetricsSink | None = None, report: ReportFile | None = None
    ) -> None:
        """Hand the result to a component's output artifacts."""
        if metrics is not None:
            for name, value in self.metrics.items():
                metrics.log_metric(name, float(value))
        if report is not None:
            Path(report.path).parent.mkdir(parents=True, exist_ok=True)
            Path(report.path).write_text(self.report)


def open_tracker(cfg: PipelineConfig, kfp_run_id: str) -> Tracker:
    """The MLflow store of a pipeline run (fails here, in seconds, naming the URI, when the
    tracking server is down)."""
    check_reachable(cfg.mlflow_tracking_uri)
    tracking = select(cfg, kfp_run_id).tracking
    return Tracker.open(
        cfg.mlflow_tracking_uri, cfg.experiment_name, kfp_run_id, tracking.artifact_location
    )


@dataclass(frozen=True)
class StageContext:
    cfg: PipelineConfig
    tracker: Tracker
    parent_run_id: str
    kfp_run_id: str
    backends: Backends = field(init=False, repr=False, compare=False)
    _started: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    _runs: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", select(self.cfg, self.kfp_run_id))

    @classmethod
    def load(cls, config_json: str, parent_run_id: str, kfp_run_id: str) -> StageContext:
        cfg = PipelineConfig.model_validate_json(config_json)
        return cls(cfg, open_tracker(cfg, kfp_run_id), parent_run_id, kfp_run_id)

    @contextmanager
    def stage(self, name: str, shown: str = "") -> Iterator[str]:
        """The stage's MLflow child run: FAILED with the reason when the body raises.
        `shown`: the step's name in what a person reads, when it is not the run's."""
        print(f"kubellm: {shown or name} started", flush=True)
        self._started[name] = time.monotonic()
        with self.tracker.stage(self.parent_run_id, name) as run_id:
            self._runs[name] = run_id
            yield run_id

    def finish(self, name: str, result: _R, shown: str = "") -> _R:
        """Print the line a person sees when the stage ends (`kubellm run` shows it), and
        keep the stage's report as `report.md` of its MLflow run (the same text as its KFP
        Markdown artifact)."""
        if result.report and name in self._runs:
            self.tracker.client.log_text(self._runs[name], redact(result.report), "report.md")
        seconds = time.monotonic() - self._started.get(name, time.monotonic())
        took = f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"
        print(f"kubellm: {shown or name} done in {took}s: {result.headline}", flush=True)
        end_kfp_step_fast()  # a KFP step ends without the interpreter's teardown (2 s of CPU)
        return result

    def stage_runs(self) -> dict[str, Any]:
        """The latest child run of each stage so far, by stage name (for lineage)."""
        out: dict[str, Any] = {}
        for run in self.tracker.children(self.parent_run_id):
            out[run.data.tags.get(TAG_STAGE, run.info.run_name)] = run
        return out

    @property
    def plan(self) -> JobPlan:
        return JobPlan(self.cfg, self.kfp_run_id, self.backends.workspace.pvc_name)

    def job(
        self,
        name: str,
        args: list[str],
        module: str = "kubellm.train",
        timeout_s: float | None = None,
    ) -> TrainJob:
        """A job of this run with the training topology, image and workspace."""
        return self.plan.job(name, args, module, timeout_s)

    def train_job(self, name: str, train_cfg: TrainConfig) -> TrainJob:
        """A training job, its config written where jobs read it."""
        path = self.backends.workspace.dir("config") / f"{name}.json"
        path.write_text(train_cfg.model_dump_json(indent=2))
        return self.plan.train_job(name, path)


@dataclass(frozen=True)
class JobPlan:
    """The jobs of a run as the launchers receive them, without running anything: the
    stages and `kubellm render` build them here, so what render prints is what runs."""

    cfg: PipelineConfig
    kfp_run_id: str
    workspace_pvc: str | None

    def job(
        self,
        name: str,
        args: list[str],
        module: str = "kubellm.train",
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
    ) -> TrainJob:
        """`timeout_s` defaults to job_timeout_minutes."""
        cfg = self.cfg
        return TrainJob(
            name=dns_name(cfg.model_name, name, self.kfp_run_id[:12]),
            train_args=args,
            module=module,
            nnodes=cfg.num_nodes,
            nproc_per_node=cfg.nproc_per_node,
            timeout_s=cfg.job_timeout_minutes * 60.0 if timeout_s is None else timeout_s,
            image=cfg.trainer_image,
            namespace=cfg.namespace,
            env=env or {},
            workspace_pvc=self.workspace_pvc,
        )

    def train_job(self, name: str, config_path: str | Path) -> TrainJob:
        """A training job reading its TrainConfig from `config_path`; rank 0 logs to MLflow."""
        env = {"MLFLOW_TRACKING_URI": self.cfg.mlflow_tracking_uri}
        return self.job(name, ["--config", str(config_path)], env=env)


def write_json(path: str | Path, value: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(value, indent=2, sort_keys=True))


def markdown_table(title: str, rows: list[tuple[str, Any]], intro: str = "") -> str:
    """A stage report: a heading, an optional sentence, a two-column table."""
    lines = [f"# {title}", ""]
    if intro:
        lines += [intro, ""]
    lines += ["| | |", "|---|---|", *(f"| {k} | {fmt(v)} |" for k, v in rows)]
    return "\n".join(lines) + "\n"


def fmt(value: Any) -> str:
    """A figure as people read it: integers without `.0`, other floats to 4 digits."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    return str(value)


def last_line(error: str) -> str:
    """What an error says in one line: its last non-empty line (a traceback's or a wrapped
    error's reason comes last; its first line is often only where it happened)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
