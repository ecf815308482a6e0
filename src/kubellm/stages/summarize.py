"""The exit handler's work: stop what lived only for the run, close the lineage, summarise.

It runs whether the pipeline succeeded or failed, so it reads everything from MLflow (the
only place every stage wrote to) rather than from task outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubellm import backends
from kubellm.config import pipeline_config
from kubellm.stages.context import StageResult, fmt, open_tracker
from kubellm.stages.record_data import TAG_UNCHANGED
from kubellm.tracking import TAG_FINGERPRINT, TAG_STAGE, Tracker


@dataclass
class Result(StageResult):
    state: str = ""


def build_summary(
    tracker: Tracker, parent: str | None, state: str, ui_cmd: str, model_name: str
) -> str:
    lines = [f"# kubellm run {tracker.kfp_run_id}: {state}", ""]
    if parent is None:
        lines.append("No MLflow parent run was found (preflight did not get that far).")
        return "\n".join(lines) + "\n"
    runs = {r.data.tags.get(TAG_STAGE): r for r in tracker.children(parent)}

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
    failed = [
        f"- {stage}: {run.data.tags.get('kubellm.error', '')}"
        for stage, run in runs.items()
        if run.info.status == "FAILED"
    ]
    if failed:
        lines += ["", "Failed stages:", *failed]
    lines += ["", f"MLflow parent run: `{parent}`", f"Open the MLflow UI: `{ui_cmd}`"]
    return "\n".join(lines) + "\n"


def run(params: dict[str, Any], kfp_run_id: str, state: str, error: str = "") -> Result:
    """`params`: the pipeline parameters the exit handler gets (it has no preflight output:
    preflight may be what failed)."""
    cfg = backends.resolve(pipeline_config(params))
    chosen = backends.select(cfg, kfp_run_id)
    released = chosen.server.release(kfp_run_id)
    if released:
        print(f"summary: stopped {released} local model server(s)", flush=True)
    tracker = open_tracker(cfg, kfp_run_id)
    parent = tracker.find_parent()
    if parent is not None:
        killed = tracker.kill_running_children(
            parent, f"still RUNNING when the pipeline ended {state}: its step was killed"
        )
        if killed:
            print(f"summary: marked KILLED in MLflow: {', '.join(killed)}", flush=True)
        tracker.log(parent, tags={"kubellm.state": state, "kubellm.error": error[:4000]})
        tracker.finish_parent(parent, state == "SUCCEEDED")
    text = build_summary(tracker, parent, state, chosen.tracking.ui_hint, cfg.model_name)
    print(text, flush=True)
    return Result(report=text, headline=state, state=state)
