"""Held-out evaluation: loss and perplexity on the val split; bits per byte on its text;
exact match, generation latency and tokens/s on prompt/answer examples (the data's held-out
ones, or a user task: kubellm.evaluate.tasks).

Loss and perplexity are per token of the dataset's tokenizer: they mean something only for a
model of that tokenizer. Bits per byte (the target text's nats / ln 2 / its UTF-8 bytes) is
the same quantity measured per byte of text: each model scores its own tokenization of the
same held-out texts, so models of different tokenizers compare on it."""

from __future__ import annotations

import math
import time
from itertools import groupby
from pathlib import Path
from typing import Any

import torch

from kubellm.data.artifact import IGNORE_INDEX, load_eval_examples, load_split, tokenizer_dir
from kubellm.serve.generate import greedy_with_margins, load_model

# A held-out row as text: (text, scored) pieces in order. Scored pieces are the row's target
# text (what its loss counts); the others are context only (the row's first token, masked
# prompt tokens, special tokens such as the EOS between packed documents).
Row = list[tuple[str, bool]]


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


def heldout_texts(dataset_dir: str | Path, tokenizer: Any | None = None) -> list[Row]:
    """The val split's rows as text, decoded with the dataset's tokenizer (`tokenizer`, or
    the one the dataset ships). A token is scored when heldout_loss counts it (a label, not
    the row's first) and it is not a special token (an EOS or padding has no text to
    measure in bytes); a row's trailing context is dropped (nothing after it is scored)."""
    from kubellm.data.tokenizer import load_tokenizer

    tok = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir(dataset_dir))
    special = set(tok.all_special_ids)
    x, y = load_split(str(dataset_dir), "val")
    rows: list[Row] = []
    for ids, labels in zip(x.tolist(), y.tolist(), strict=True):
        flags = [
            i > 0 and label != IGNORE_INDEX and token not in special
            for i, (token, label) in enumerate(zip(ids, labels, strict=True))
        ]
        row: Row = []
        for scored, run in groupby(zip(ids, flags, strict=True), key=lambda p: p[1]):
            text = tok.decode(
                [token for token, _ in run],
                skip_special_tokens=False,
                clean_up_tokenization_spaces=False,
            )
            row.append((str(text), scored))
        while row and not row[-1][1]:
            row.pop()
        if row:
            rows.append(row)
    return rows


@torch.no_grad()
def bits_per_byte(model: Any, tokenizer: Any, rows: list[Row], batch_size: int = 32) -> float:
    """Total nats of the scored text, each piece tokenized by the model's own `tokenizer`,
    over ln 2 and the text's UTF-8 bytes. Rows longer than the model's context are scored in
    windows that each start on the last token of the one before (every token but a row's
    first is predicted once)."""
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
    windows: list[tuple[list[int], list[int]]] = []
    nbytes = 0
    for row in rows:
        ids: list[int] = []
        labels: list[int] = []
        for text, scored in row:
            piece = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if scored and not ids:  # nothing before it to predict it from
                continue
            ids += piece
            labels += piece if scored else [IGNORE_INDEX] * len(piece)
            nbytes += len(text.encode("utf-8")) if scored else 0
        for start in range(0, max(len(ids) - 1, 0), limit - 1):
            window = (ids[start : start + limit], labels[start : start + limit])
            if any(label != IGNORE_INDEX for label in window[1][1:]):
                windows.append(window)
    windows.sort(key=lambda w: len(w[0]))  # batches of similar lengths pad little
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    nats = 0.0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), width), pad, dtype=torch.long)
        y = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, labels) in enumerate(batch):
            x[i, : len(ids)] = torch.tensor(ids)
            y[i, : len(labels)] = torch.tensor(labels)
            mask[i, : len(ids)] = 1
        logits = model(input_ids=x.to(model.device), attention_mask=mask.to(model.device)).logits
        nats += float(
            torch.nn.functional.cross_entropy(
                logits[:, :-1].float().flatten(0, 1),
                y[:, 1:].flatten().to(logits.device),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        )
    return nats / math.log(2) / max(nbytes, 1)


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
    token_loss: bool = True,
    texts: list[Row] | None = None,
) -> dict[str, Any]:
    """Metrics and the predictions on prompt/answer examples (the smoke test compares with
    them): `examples` (a user task) or else the dataset's held-out ones. `dtype` (the
    serving dtype, config serving_dtype) is what the weights are loaded in, so the smoke
    test compares the server with answers computed at the precision it serves; None: the
    checkpoint's own. `token_loss` False: the model's tokenizer is not the dataset's, so no
    eval_loss or perplexity on its token ids (bits_per_byte only). `texts`: heldout_texts of
    the dataset, when the caller has them already."""
    # a GPU when the step has one (evaluate_gpus), else the CPU
    model, tokenizer = load_model(
        model_dir, device="cuda" if torch.cuda.is_available() else None, dtype=dtype
    )
    metrics: dict[str, Any] = {}
    if token_loss:
        loss = heldout_loss(model, dataset_dir)
        metrics.update(eval_loss=loss, perplexity=math.exp(min(loss, 50.0)))
    rows = heldout_texts(dataset_dir) if texts is None else texts
    metrics["bits_per_byte"] = bits_per_byte(model, tokenizer, rows)
    scored = True
    if examples is None:
        examples = load_eval_examples(dataset_dir, max_examples)
    if not examples:  # plain text: continuations to show and to smoke-test, not to score
        # the held-out ids are the dataset tokenizer's, whichever the model's is
        from kubellm.data.tokenizer import load_tokenizer

        ours = tokenizer if token_loss else load_tokenizer(tokenizer_dir(dataset_dir))
        examples, scored = continuations(ours, dataset_dir), False
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
