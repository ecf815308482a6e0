"""Evaluation tasks: which prompt/answer pairs exact match is measured on.

- built in: the held-out examples prepare_data kept aside (`eval/examples.parquet`: for the
  default corpus, additions it never trained on);
- a user task: a JSONL of prompt/answer records given as `eval_data` (a path or any fsspec
  URI, optionally .gz/.zst), scored by exact match of the greedy completion. It replaces the
  built-in examples, for the candidate and the champion alike, so the gate compares both on
  the task the user cares about.

Held-out loss and perplexity always come from the val split (kubellm.evaluate.metrics).
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from kubellm.data.records import DataError

PROMPT_KEYS = ("prompt", "question", "input")
ANSWER_KEYS = ("completion", "answer", "response", "output")


def _field(row: dict[str, Any], keys: tuple[str, ...], where: str) -> str:
    for key in keys:
        if key in row:
            value = row[key]
            if not isinstance(value, str):
                raise DataError(f"{where}: field {key!r} is {type(value).__name__}, not a string")
            return value
    raise DataError(f"{where}: no {' / '.join(repr(k) for k in keys)} field (has {sorted(row)})")


def load_task(uri: str, limit: int | None = None) -> list[dict[str, str]]:
    """The prompt/completion pairs of a JSONL task file, in file order (at most `limit`).

    Each line is an object with a prompt (`prompt`, `question` or `input`) and its expected
    answer (`completion`, `answer`, `response` or `output`); blank lines are skipped. Any
    other line is an error naming the file and line: a task silently shrunk by bad lines
    would gate on fewer examples than the user thinks.
    """
    examples: list[dict[str, str]] = []
    try:
        with fsspec.open(uri, "rt", compression="infer", encoding="utf-8") as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"eval_data {uri}:{n}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: not JSON ({err.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{where}: a JSON {type(row).__name__}, not an object")
                prompt = _field(row, PROMPT_KEYS, where)
                if not prompt:
                    raise DataError(f"{where}: the prompt is empty")
                examples.append({"prompt": prompt, "completion": _field(row, ANSWER_KEYS, where)})
                if limit is not None and len(examples) >= limit:
                    break
    except FileNotFoundError:
        raise DataError(f"eval_data {uri} does not exist") from None
    if not examples:
        raise DataError(f"eval_data {uri} has no prompt/answer records")
    return examples
