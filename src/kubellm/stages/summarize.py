"""The exit handler's work: stop what lived only for the run, close the lineage, summarise.

It runs whether the pipeline succeeded or failed, so it reads everything from MLflow (the
only place every stage wrote to) rather than from task outputs.

The state it is handed is the backend's word, and the backends say it differently: kfp.local
says `SUCCEEDED`/`FAILED`; the KFP backend hands the exit handler the MLMD execution's raw
state (kubeflow/pipelines backend/src/v2/driver/resolve.go at 2.17.0:
`State: producer.GetExecution().GetLastKnownState().String()`), `COMPLETE` or `FAILED` for
the exit handler's DAG (metadata/client.go `UpdateDAGExecutionsState`), and never fills the
error (`Error: &status.Status{}`, "TODO: Implement fields Message and Code"). So success is
either word, the summary and the MLflow parent say SUCCEEDED or FAILED, the raw state is
kept in the tag `kubellm.backend_state`, and the error text comes from the stage runs when
the backend gives none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubellm import backends
from kubellm.config import PipelineConfig, pipeline_config
from kubellm.evaluate.gate import PROMOTE
from kubellm.process import end_kfp_step_fast
from kubellm.stages import DAG
from kubellm.stages.context import StageResult, fmt, last_line, open_tracker
from kubellm.stages.record_data import TAG_UNCHANGED
from kubellm.tracking import TAG_FINGERPRINT, TAG_STAGE, Tracker

# What each backend calls success (see the module docstring).
SUCCESS_STATES = frozenset({"SUCCEEDED", "COMPLETE"})
SUCCEEDED, FAILED = "SUCCEEDED", "FAILED"
# MLflow statuses of a stage run that did not finish: FAILED (the stage raised) and KILLED
# (its step died with the run still open; kill_running_children marks those).
_UNFINISHED = ("FAILED", "KILLED")
NO_STAGE_ERROR = (
    "no stage recorded an error: a step failed before or outside its stage (its pod was "
    "refused, evicted or killed, or the KFP driver or launcher failed); read that step's log"
)


@dataclass
class Result(StageResult):
    state: str = ""


def outcome(state: str) -> str:
    """SUCCEEDED for what the backend calls success, FAILED for anything else (FAILED,
    CANCELED, a DAG left RUNNING by a stopped run)."""
    return SUCCEEDED if state.strip() in SUCCESS_STATES else FAILED


def stage_failures(runs: list[Any]) -> list[tuple[str, str]]:
    """(stage label, its error's last line) of every stage run that did not finish, in run
    order (the stage run keeps the whole error in its kubellm.error tag)."""
    out = []
    for run in runs:
        if run.info.status in _UNFINISHED:
            stage = str(run.data.tags.get(TAG_STAGE, run.info.run_id))
            label = stage if run.info.status == "FAILED" else f"{stage} (KILLED)"
            error = last_line(run.data.tags.get("kubellm.error", "")) or "(no error recorded)"
            out.append((label, error))
    return out


# The stages that record an MLflow run, in DAG order: "prepare_data" is the run record_data
# makes for both data steps (prepare_data keeps none: its cache key is its data alone); tune
# records one even with tune_trials=0.
RECORDED_STAGES = ("preflight", *(stage for stage in DAG if stage != "record_data"))


def stopped_at(runs: list[Any]) -> str:
    """Where a run that failed without a stage run recording it stopped: the first stage in
    DAG order without a run ("prepare_data or record_data" for the data steps' run); "" where
    the DAG itself stops there (unchanged data, a rejected gate) or every stage has a run."""
    by_stage = {r.data.tags.get(TAG_STAGE): r for r in runs}
    for stage in RECORDED_STAGES:
        if stage in by_stage:
            continue
        if stage == "preflight":
            return stage
        if stage == "prepare_data":
            return "prepare_data or record_data"
        if "training skipped" in by_stage["prepare_data"].data.tags.get(TAG_UNCHANGED, ""):
            return ""
        evaluated = by_stage.get("evaluate")
        if evaluated is not None and evaluated.data.tags.get("kubellm.gate") != PROMOTE:
            return ""
        return stage
    return ""


def failure_reason(failures: list[tuple[str, str]], error: str, stopped: str = "") -> str:
    """The error text of a failed run: the stage runs' (with the backend's, when it gave
    one), else the backend's, else why there is none; `stopped` (stopped_at) names the
    step where no stage run recorded it."""
    text = "; ".join(f"{stage}: {err}" for stage, err in failures)
    if text and error:
        return f"{text} (backend: {error})"
    if text:
        return text
    where = f"stopped at {stopped}, which recorded no MLflow run: " if stopped else ""
    return where + (error or NO_STAGE_ERROR)


def build_summary(
    tracker: Tracker,
    parent: str | None,
    state: str,
    ui_cmd: str,
    model_name: str,
    error: str = "",
) -> str:
    """The run's Markdown summary. `state` is the backend's raw state; the header says
    SUCCEEDED or FAILED, and a failed run always lists why under "Failed stages:"."""
    result = outcome(state)
    lines = [f"# kubellm run {tracker.kfp_run_id}: {result}", ""]
    if result == FAILED and state.strip() != FAILED:  # CANCELED, a DAG left RUNNING, ...
        lines += [f"The pipeline backend reported the state `{state}`.", ""]
    if parent is None:
        lines.append("No MLflow parent run was found (preflight did not get that far).")
        if result == FAILED:
            lines += ["", "Failed stages:", f"- {failure_reason([], error)}"]
        return "\n".join(lines) + "\n"
    children = tracker.children(parent)
    runs = {r.data.tags.get(TAG_STAGE): r for r in children}

    def metric(stage: str, key: str) -> Any:
        run = runs.get(stage)
        return run.data.metrics.get(key, "-") if run else "-"

    def tag(stage: str, key: str) -> str:
        run = runs.get(stage)
        return run.data.tags.get(key, "-") if run else "-"

    def param(stage: str, key: str) -> str:
        run = runs.get(stage)
        return run.data.params.get(key, "-") if run else "-"

    # (stage the row comes from, label, value): rows of stages that did not run are left
    # out, so a run that stopped early (unchanged data, a rejected gate) reads cleanly
    rows = [
        (
            "prepare_data",
            "records read / kept",
            f"{fmt(metric('prepare_data', 'records_read'))} / "
            f"{fmt(metric('prepare_data', 'records_kept'))}",
        ),
        (
            "prepare_data",
            "tokens (train / val)",
            f"{fmt(metric('prepare_data', 'tokens_train'))} / "
            f"{fmt(metric('prepare_data', 'tokens_val'))}",
        ),
        ("prepare_data", "data fingerprint", tag("prepare_data", TAG_FINGERPRINT)[:16]),
        (
            "preflight",
            "fabric all-reduce busbw (GB/s)",
            fmt(metric("preflight", "allreduce_busbw_gbps")),
        ),
        (
            "tune",
            "best trial",
            f"{tag('tune', 'kubellm.best_trial')} (lr "
            f"{param('tune', 'best_learning_rate')}, eval_loss "
            f"{fmt(metric('tune', 'best_eval_loss'))})",
        ),
        ("train", "final train loss", fmt(metric("train", "train_loss"))),
        (
            "evaluate",
            "eval loss / perplexity",
            f"{fmt(metric('evaluate', 'eval_loss'))} / {fmt(metric('evaluate', 'perplexity'))}",
        ),
        ("evaluate", "held-out bits per byte", fmt(metric("evaluate", "bits_per_byte"))),
        ("evaluate", "held-out exact match", fmt(metric("evaluate", "exact_match"))),
        (
            "evaluate",
            "gate",
            f"{tag('evaluate', 'kubellm.gate')} ({tag('evaluate', 'kubellm.gate_reason')})",
        ),
        (
            "register",
            "model name / version",
            f"{model_name} / {tag('register', 'kubellm.model_version')}",
        ),
        ("deploy", "endpoint", tag("deploy", "kubellm.endpoint")),
        (
            "smoke_test",
            "prompt -> answer",
            f"{param('smoke_test', 'prompt')!r} -> {param('smoke_test', 'answer')!r} "
            f"(expected {param('smoke_test', 'expected')!r})",
        ),
        (
            "smoke_test",
            "served answers = evaluated (share)",
            fmt(metric("smoke_test", "agreement")),
        ),
        (
            "smoke_test",
            "served exact match (smoke prompts)",
            fmt(metric("smoke_test", "served_exact_match")),
        ),
    ]
    table = [(label, value) for stage, label, value in rows if stage in runs]
    unchanged = tag("prepare_data", TAG_UNCHANGED)
    if unchanged != "-":
        table.insert(3, ("data", unchanged))
        if "training skipped" in unchanged:
            lines += [unchanged[0].upper() + unchanged[1:] + ".", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in table]
    failed = [f"- {stage}: {err}" for stage, err in stage_failures(children)]
    if result == FAILED and not failed:
        failed = [f"- {failure_reason([], error, stopped_at(children))}"]
    if failed:
        lines += ["", "Failed stages:", *failed]
    lines += ["", f"MLflow parent run: `{parent}`", f"Open the MLflow UI: `{ui_cmd}`"]
    return "\n".join(lines) + "\n"


def champion_version(cfg: PipelineConfig) -> str | None:
    """The version the registry's `champion` alias points at: "" when there is none (no
    model, no alias), None when the registry cannot say (the cleanup then keeps every
    deployment that serves: it may be the champion's)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from kubellm.tracking import CHAMPION, check_reachable

    try:
        check_reachable(cfg.mlflow_tracking_uri)
        client = MlflowClient(cfg.mlflow_tracking_uri)
        return str(client.get_model_version_by_alias(cfg.model_name, CHAMPION).version)
    except MlflowException as e:
        missing = e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
        return "" if missing and "not found" in str(e) else None
    except Exception:  # unreachable (TrackingUnavailable), refused, ...: unknown
        return None


def run(params: dict[str, Any], kfp_run_id: str, state: str, error: str = "") -> Result:
    """`params`: the pipeline parameters the exit handler gets (it has no preflight output:
    preflight may be what failed). `state` and `error`: the PipelineTaskFinalStatus the
    backend handed the exit handler, as it gave them (see the module docstring)."""
    result = outcome(state)
    cfg = backends.resolve(pipeline_config(params))
    chosen = backends.select(cfg, kfp_run_id)
    released = chosen.server.release(kfp_run_id)
    if released:
        print(f"summary: stopped {released} local model server(s)", flush=True)
    # A cluster's jobs, experiments and unpromoted deployments of the run, before MLflow
    # (which may be what failed): kubellm.backends.kubernetes.release says why here.
    for line in chosen.release_run(champion_version(cfg)):
        print(f"summary: {line}", flush=True)
    tracker = open_tracker(cfg, kfp_run_id)
    parent = tracker.find_parent()
    if parent is not None:
        killed = tracker.kill_running_children(
            parent, f"still RUNNING when the pipeline ended {result}: its step was killed"
        )
        if killed:
            print(f"summary: marked KILLED in MLflow: {', '.join(killed)}", flush=True)
        reason = ""
        if result == FAILED:
            children = tracker.children(parent)
            reason = failure_reason(stage_failures(children), error, stopped_at(children))
        tags = {"kubellm.state": result, "kubellm.backend_state": state, "kubellm.error": reason}
        tracker.log(parent, tags={k: v[:4000] for k, v in tags.items()})
        tracker.finish_parent(parent, result == SUCCEEDED)
    text = build_summary(tracker, parent, state, chosen.tracking.ui_hint, cfg.model_name, error)
    print(text, flush=True)
    end_kfp_step_fast()  # as StageContext.finish does
    return Result(report=text, headline=result, state=result)
