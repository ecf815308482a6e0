"""Held-out evaluation: loss and perplexity on the val split; exact match, generation latency
and tokens/s on prompt/answer examples (the data's held-out ones, or a user task:
kubellm.evaluate.tasks)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from kubellm.data.artifact import IGNORE_INDEX, load_eval_examples, load_split
from kubellm.serve.generate import greedy_with_margins, load_model


@torch.no_grad()
def heldout_loss(model: Any, dataset_dir: str | Path, batch_size: int = 64) -> float:
    """Mean loss per predicted token over the whole val split (every target token counts
    once, however the rows are batched; masked prompt tokens and padding count not at all)."""
    val = load_split(str(dataset_dir), "val")
    total, count = 0.0, 0
    for start in range(0, val.shape[1], batch_size):
        x, y = val[:, start : start + batch_size].long().to(model.device)
        targets = int((y[:, 1:] != IGNORE_INDEX).sum())  # causal LMs predict token t+1
        if targets:
            total += float(model(input_ids=x, labels=y).loss) * targets
            count += targets
    return total / max(count, 1)


CONTINUATIONS = 16  # held-out text prefixes a plain-text model is asked to continue
CONTINUATION_TOKENS = 8


def continuations(
    tokenizer: Any, dataset_dir: str | Path, n: int = CONTINUATIONS
) -> list[dict[str, str]]:
    """Prompts for data without prompt/answer pairs (plain text): the first half of held-out
    rows, each with the text that followed it as its reference. Not a task (no exact match is
    reported on them): they are what the model is seen generating, in the report and by the
    smoke test, which checks the served model continues them as this one did."""
    x, y = load_split(str(dataset_dir), "val")
    half = x.shape[1] // 2
    out = []
    for row in range(min(n, x.shape[0])):
        ids, kept = x[row].tolist(), (y[row] != IGNORE_INDEX).tolist()
        prompt = tokenizer.decode(ids[:half], skip_special_tokens=True).strip()
        follows = ids[half : half + CONTINUATION_TOKENS]
        if prompt and all(kept[:half]):  # whole prompt of real tokens (no padding)
            reference = tokenizer.decode(follows, skip_special_tokens=True).strip()
            out.append({"prompt": prompt, "completion": reference})
    return out


def evaluate(
    model_dir: str | Path,
    dataset_dir: str | Path,
    max_examples: int = 256,
    examples: list[dict[str, str]] | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Metrics and the predictions on prompt/answer examples (the smoke test compares with
    them): `examples` (a user task) or else the dataset's held-out ones. `dtype` (the
    serving dtype, config serving_dtype) is what the weights are loaded in, so the smoke
    test compares the server with answers computed at the precision it serves; None: the
    checkpoint's own."""
    # a GPU when the step has one (evaluate_gpus), else the CPU
    model, tokenizer = load_model(
        model_dir, device="cuda" if torch.cuda.is_available() else None, dtype=dtype
    )
    loss = heldout_loss(model, dataset_dir)
    metrics: dict[str, Any] = {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    scored = True
    if examples is None:
        examples = load_eval_examples(dataset_dir, max_examples)
    if not examples:  # plain text: continuations to show and to smoke-test, not to score
        examples, scored = continuations(tokenizer, dataset_dir), False
    examples = examples[:max_examples]
    predictions: list[dict[str, Any]] = []
    if examples:
        longest = max(len(tokenizer(e["completion"])["input_ids"]) for e in examples)
        max_new = longest + 2
        began = time.perf_counter()
        # with each answer's smallest top-2 logit gap: a near-tie can go either way on another
        # runtime or batch, and the smoke test excuses a served answer that differs there
        margins = greedy_with_margins(model, tokenizer, [e["prompt"] for e in examples], max_new)
        answers = [answer for answer, _ in margins]
        seconds = max(time.perf_counter() - began, 1e-9)
        generated = sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)
        # one prompt at a time, greedy, cut at EOS: what a single request waits
        metrics["gen_latency_ms"] = 1000.0 * seconds / len(examples)
        metrics["gen_tokens_per_sec"] = generated / seconds
        for ex, (answer, gap) in zip(examples, margins, strict=True):
            predictions.append(
                {
                    **ex,
                    "prediction": answer,
                    "correct": answer == ex["completion"],
                    "max_new_tokens": max_new,
                    "min_logit_gap": gap,
                }
            )
        if scored:
            metrics["exact_match"] = sum(p["correct"] for p in predictions) / len(predictions)
            metrics["eval_examples"] = len(predictions)
    return {"metrics": metrics, "predictions": predictions}
