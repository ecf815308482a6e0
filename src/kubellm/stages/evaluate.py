"""The evaluate stage: the candidate's held-out metrics, the champion's on the same data (the
same code, the champion's weights from the registry), and the gate (kubellm.evaluate.gate).

The tokenizers are compared before the champion is scored: the held-out token ids are the
dataset's tokenizer's, so a champion of another tokenizer gets no loss on them (its
embedding may not even have rows for them); it is scored on its own tokenization of the
same held-out texts (bits_per_byte), and the gate compares on that.

Its report is written twice, Markdown and a self-contained HTML page (kubellm.evaluate.report:
the decision with its reasons, candidate vs champion, the training loss curve read back from
the train stage's MLflow run, sample generations of both). KFP's UI shows them as the
component's artifacts; the evaluate MLflow run keeps them, with both models' predictions, so
the registry's lineage leads to the evidence behind a promotion without KFP."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubellm.data.artifact import load_eval_examples, load_manifest
from kubellm.data.records import DataError
from kubellm.evaluate.gate import PROMOTE, REJECT, Champion, decide
from kubellm.evaluate.metrics import Row, evaluate, heldout_texts
from kubellm.evaluate.report import html_report, pair_samples
from kubellm.evaluate.tasks import for_model, load_task
from kubellm.stages.context import (
    StageContext,
    StageResult,
    last_line,
    markdown_table,
    write_json,
)

__all__ = ["PROMOTE", "REJECT", "Result", "run"]

MAX_EXAMPLES = 256  # evaluate()'s default: the examples both models are asked
# What the register stage makes the MLflow model's input example and default max_new_tokens
# (kubellm.tracking.registry.PredictDefaults): a prompt of this data and the budget its
# longest held-out completion was given.
TAG_INPUT_EXAMPLE = "kubellm.input_example"
TAG_MAX_NEW_TOKENS = "kubellm.max_new_tokens"
# The evaluation dataset (the prepared data's val split) as MLflow names it: name and digest.
TAG_EVAL_DATASET = "kubellm.eval_dataset"
MAX_EXAMPLE_CHARS = 2000  # an input example is shown, not a document


@dataclass
class Result(StageResult):
    decision: str = REJECT  # the DAG's gate condition: PROMOTE or REJECT
    reason: str = ""


def tokenizer_difference(model_dir: Path, dataset_dir: Path) -> str:
    """How the model's tokenizer differs from the dataset's, e.g. "champion vocab 300,
    candidate 1024"; empty when it is the same (loss on the dataset's token ids means
    something only then)."""
    from kubellm.data.artifact import tokenizer_dir
    from kubellm.data.tokenizer import load_tokenizer
    from kubellm.serve.layout import model_paths

    ours = load_tokenizer(tokenizer_dir(dataset_dir))
    try:
        theirs = load_tokenizer(model_paths(model_dir)[1])
    except (OSError, ValueError) as e:
        return f"the champion's tokenizer does not load: {e}"
    if theirs.get_vocab() == ours.get_vocab():
        return ""
    if len(theirs) == len(ours):
        return f"champion and candidate vocab {len(ours)}, other tokens"
    return f"champion vocab {len(theirs)}, candidate {len(ours)}"


def chat_format(model_dir: str | Path) -> Any:
    """The model's chat format (kubellm.data.templates.ChatFormat) from its exported
    tokenizer's template; None without one (its server refuses chats, so must its gate)."""
    from kubellm.data.templates import ChatFormat
    from kubellm.data.tokenizer import load_tokenizer
    from kubellm.serve.layout import model_paths

    tokenizer = load_tokenizer(model_paths(Path(model_dir))[1])
    if not getattr(tokenizer, "chat_template", None):
        return None
    return ChatFormat.from_tokenizer(tokenizer)


@dataclass(frozen=True)
class ChampionScore:
    """The champion as the gate sees it, and what it generated (the report shows both)."""

    champion: Champion | None
    about: str  # "champion vN", or why there is none
    predictions: list[dict[str, Any]] = field(default_factory=list)


def champion_on(
    ctx: StageContext,
    dataset_dir: Path,
    task: list[dict[str, str]] | None = None,
    texts: list[Row] | None = None,
) -> ChampionScore:
    """The current champion measured on this run's evaluation data (and `task`, the user's
    eval_data, when given); without one, why. `texts`: the held-out texts (heldout_texts),
    which it scores on its own tokenization."""
    mv = ctx.tracker.champion(ctx.cfg.model_name)
    if mv is None:
        return ChampionScore(None, "no champion yet")
    from kubellm.tracking.registry import download_hf_dir

    with tempfile.TemporaryDirectory(prefix="champion-") as tmp:
        # a Hugging Face directory whichever layout the version was registered in (a failed
        # download fails the step: the storage may answer when the step is retried)
        local = download_hf_dir(ctx.tracker.client, mv, Path(tmp) / "model")
        differs = ""
        examples = task if task is not None else load_eval_examples(dataset_dir, MAX_EXAMPLES)
        try:
            # before any scoring: another tokenizer's ids are not this model's tokens
            differs = tokenizer_difference(local, dataset_dir)
            # chats asked in the champion's own template, as its server would be asked them
            examples = for_model(examples, chat_format(local))
            scored: dict[str, Any] = evaluate(
                local,
                dataset_dir,
                examples=examples,
                dtype=ctx.cfg.serving_dtype,
                token_loss=not differs,
                texts=texts,
            )
        except Exception as err:  # the version as registered cannot be compared
            # a champion that does not load or score is one the gate cannot compare (it
            # stays, unless gate_allow_incomparable): a crash here failed every later run
            # until someone moved the alias by hand
            why = (
                str(err)
                if isinstance(err, DataError)
                else f"{type(err).__name__}: {last_line(str(err))}"
            )
            about = f"champion v{mv.version} (not measured: {why})"
            print(f"evaluate: {about}", flush=True)
            return ChampionScore(Champion(str(mv.version), {}, differs, why), about)
    return ChampionScore(
        Champion(str(mv.version), dict(scored["metrics"]), differs),
        f"champion v{mv.version}",
        scored["predictions"],
    )


LOSS_KEYS = ("loss", "train_loss")  # the trainer's loss every log_every steps; its final one


@dataclass(frozen=True)
class LossCurve:
    """The training loss of this pipeline run as the trainer logged it to MLflow."""

    name: str
    points: list[tuple[float, float]]  # (step, value), in step order
    train_run: str = ""  # its MLflow run id ("" without one)
    missing: str = ""  # why there are no points


def training_loss(ctx: StageContext) -> LossCurve:
    """The curve of the train stage's run (a sibling of this stage's run): every log_every
    steps, in step order (a resumed run logs its steps again, the newest last)."""
    train = ctx.stage_runs().get("train")
    if train is None:
        return LossCurve(LOSS_KEYS[0], [], missing="this pipeline run has no train stage run")
    run_id = str(train.info.run_id)
    for key in LOSS_KEYS:
        history = ctx.tracker.client.get_metric_history(run_id, key)
        if history:
            ordered = sorted(history, key=lambda m: (m.step, m.timestamp))
            return LossCurve(key, [(float(m.step), float(m.value)) for m in ordered], run_id)
    return LossCurve(LOSS_KEYS[0], [], run_id, f"its train run {run_id} logged none")


def predict_tags(predictions: list[dict[str, Any]]) -> dict[str, str]:
    """The first evaluated prompt and its generation budget (the longest completion's), as
    tags the register stage reads for the MLflow model's input example and defaults."""
    if not predictions:
        return {}
    first = predictions[0]
    return {
        TAG_INPUT_EXAMPLE: str(first["prompt"])[:MAX_EXAMPLE_CHARS],
        TAG_MAX_NEW_TOKENS: str(int(first["max_new_tokens"])),
    }


def run(
    ctx: StageContext,
    model_dir: str | Path,
    dataset_dir: str | Path,
    predictions_path: str,
    html_path: str | None = None,
) -> Result:
    """Metrics and the gate decision; writes predictions for the smoke test and the HTML
    report (`html_path`, KFP's Output[HTML]); the evaluate MLflow run keeps both reports
    and the predictions of both models as artifacts."""
    cfg = ctx.cfg
    with ctx.stage("evaluate") as run_id:
        # the user's task (its chats in the candidate's template), else the held-out examples
        task = (
            load_task(cfg.eval_data, chat=chat_format(model_dir), allow_http=cfg.allow_http_sources)
            if cfg.eval_data
            else None
        )
        texts = heldout_texts(dataset_dir)  # what bits_per_byte measures, for both models
        # in the dtype the model will be served in: the smoke test compares with these answers
        scored = evaluate(
            model_dir, dataset_dir, examples=task, dtype=cfg.serving_dtype, texts=texts
        )
        metrics: dict[str, float] = dict(scored["metrics"])
        rival = champion_on(ctx, Path(dataset_dir), task, texts)
        champion, about = rival.champion, rival.about
        gate = decide(
            metrics,
            champion,
            asked=cfg.gate_metric,
            min_accuracy=cfg.gate_min_accuracy,
            max_perplexity=cfg.gate_max_perplexity,
            margin=cfg.gate_margin,
            guards=cfg.gate_guards,
            allow_incomparable=cfg.gate_allow_incomparable,
        )
        logged = dict(metrics)
        if champion is not None:
            logged.update({f"champion_{k}": v for k, v in champion.metrics.items()})
        write_json(predictions_path, scored["predictions"])
        # what was measured on: the held-out split, as an MLflow dataset (register links the
        # model's metrics to it)
        dataset = ctx.tracker.log_dataset(
            run_id, cfg.model_name, load_manifest(dataset_dir), "evaluation", split="val"
        )
        ctx.tracker.log(
            run_id,
            metrics=logged,
            tags={
                "kubellm.gate": gate.decision,
                "kubellm.gate_reason": gate.reason,
                "kubellm.gate_metric": gate.metric,
                "kubellm.champion": about,
                TAG_EVAL_DATASET: json.dumps(dataset),
                **predict_tags(scored["predictions"]),
            },
        )
        report = markdown_table(
            "Evaluation",
            list(logged.items()),
            f"Gate: **{gate.decision}** against {about} ({gate.reason})",
        )
        curve = training_loss(ctx)
        page = html_report(
            candidate=metrics,
            champion=champion,
            gate=gate,
            loss=curve.points,
            loss_name=curve.name,
            no_loss=curve.missing,
            samples=pair_samples(scored["predictions"], rival.predictions if champion else None),
            total_examples=len(scored["predictions"]),
            settings={
                "gate_metric": cfg.gate_metric,
                "gate_min_accuracy": cfg.gate_min_accuracy,
                "gate_max_perplexity": cfg.gate_max_perplexity,
                "gate_margin": cfg.gate_margin,
                "gate_guards": json.dumps(cfg.gate_guards, sort_keys=True),
                "gate_allow_incomparable": cfg.gate_allow_incomparable,
            },
            about={
                "model": cfg.model_name,
                "KFP run": ctx.kfp_run_id,
                "MLflow evaluate run": run_id,
                "MLflow train run": curve.train_run or "—",
            },
            no_champion=about,
        )
        if html_path:
            Path(html_path).parent.mkdir(parents=True, exist_ok=True)
            Path(html_path).write_text(page)
        # artifacts of the evaluate run (its report.md is logged by ctx.finish)
        files = {
            "report.html": page,
            "predictions.json": json.dumps(scored["predictions"], indent=2, sort_keys=True),
        }
        if champion is not None:
            files["champion_predictions.json"] = json.dumps(
                rival.predictions, indent=2, sort_keys=True
            )
        for name, text in files.items():
            ctx.tracker.client.log_text(run_id, text, name)
    headline_value = metrics.get(gate.metric)
    shown = f"{gate.metric} {headline_value:.3f}" if headline_value is not None else gate.metric
    return ctx.finish(
        "evaluate",
        Result(
            metrics=logged,
            report=report,
            headline=f"eval_loss {metrics['eval_loss']:.4g}, {shown}; gate {gate.decision}",
            decision=gate.decision,
            reason=gate.reason,
        ),
    )
