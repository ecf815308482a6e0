"""Evaluation tasks: which prompt/answer pairs exact match is measured on.

- built in: the held-out examples prepare_data kept aside (`eval/examples.parquet`: for the
  default corpus, additions it never trained on);
- a user task: a JSONL of prompt/answer records given as `eval_data` (a path or any fsspec
  URI, optionally .gz/.zst), scored by exact match of the greedy completion. It replaces the
  built-in examples, for the candidate and the champion alike, so the gate compares both on
  the task the user cares about;
- chats, in either: a record with `messages` (OpenAI format, ending with the expected
  assistant answer) is asked as the server would be asked it: its prompt is the model's chat
  template rendering of the messages before the answer, with the assistant's turn opened
  (kubellm.data.templates.ChatFormat, the rendering prepare trains on). The messages stay
  with the example, so `for_model` renders them again for a model with another template (a
  champion on another base model), and the smoke test asks them on the chat route.

Held-out loss and perplexity always come from the val split (kubellm.evaluate.metrics).
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from kubellm.data.access import check_source, missing_filesystem
from kubellm.data.records import DataError
from kubellm.data.templates import ChatFormat, check_messages

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


def load_task(
    uri: str, limit: int | None = None, chat: ChatFormat | None = None, allow_http: bool = False
) -> list[dict[str, str]]:
    """The prompt/completion pairs of a JSONL task file, in file order (at most `limit`).

    Each line is an object with a prompt (`prompt`, `question` or `input`) and its expected
    answer (`completion`, `answer`, `response` or `output`), or a chat (`messages`) rendered
    with `chat`, the model's format (required for chats); blank lines are skipped. Any
    other line is an error naming the file and line: a task silently shrunk by bad lines
    would gate on fewer examples than the user thinks.
    """
    check_source(uri, "eval_data", allow_http)  # kubellm.data.access: what it may name
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
                if "messages" in row:
                    examples.append(_chat_example(row["messages"], chat, where))
                else:
                    prompt = _field(row, PROMPT_KEYS, where)
                    if not prompt:
                        raise DataError(f"{where}: the prompt is empty")
                    answer = _field(row, ANSWER_KEYS, where)
                    examples.append({"prompt": prompt, "completion": answer})
                if limit is not None and len(examples) >= limit:
                    break
    except FileNotFoundError:
        raise DataError(f"eval_data {uri} does not exist") from None
    except ImportError as err:  # an object store whose fsspec package is not installed
        raise DataError(missing_filesystem(uri, "eval_data", err)) from None
    if not examples:
        raise DataError(f"eval_data {uri} has no prompt/answer records")
    return examples


def _chat_example(messages: Any, chat: ChatFormat | None, where: str) -> dict[str, str]:
    if chat is None:
        raise DataError(
            f"{where}: a chat (messages) is asked in the model's chat template, and none "
            "was given (a model without one cannot be asked chats)"
        )
    try:
        return chat.example(check_messages(messages))
    except ValueError as err:
        raise DataError(f"{where}: {err}") from None


def for_model(examples: list[dict[str, Any]], chat: ChatFormat | None) -> list[dict[str, Any]]:
    """`examples` with every chat's prompt rendered in `chat`, another model's format (the
    others as they are): each model is asked a chat the way its server would be asked it.
    A chat for a model without a chat template is an error, as it is on its server."""
    if not any(e.get("messages") for e in examples):
        return examples
    if chat is None:
        raise DataError("the examples are chats, and the model has no chat template")
    out = []
    for e in examples:
        if e.get("messages"):
            history = json.loads(e["messages"])
            e = {**e, "prompt": chat.generation_prompt(history)}
        out.append(e)
    return out
