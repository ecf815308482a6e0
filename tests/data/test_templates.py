"""Templates: the exact text a model trains on, and the exact prompt/completion boundary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kubellm.data.templates import render_messages, render_prompt_response


def test_prompt_response_exact_layout() -> None:
    prompt, completion = render_prompt_response("Add 2 and 3.", "5")
    assert prompt == "### Instruction:\nAdd 2 and 3.\n\n### Response:\n"
    assert completion == "5"


def test_prompt_response_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match="response must be a string, got int"):
        render_prompt_response("q", 3)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ChatCase:
    name: str
    messages: list[dict[str, str]]
    prompt: str
    completion: str


CHAT_CASES = [
    ChatCase(
        "one turn",
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        "<|user|>\nhi\n<|assistant|>\n",
        "hello\n",
    ),
    ChatCase(
        "system prompt",
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        "<|system|>\nbe brief\n<|user|>\n2+2?\n<|assistant|>\n",
        "4\n",
    ),
    ChatCase(
        "earlier assistant turns are prompt, only the last is completion",
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ],
        "<|user|>\na\n<|assistant|>\nb\n<|user|>\nc\n<|assistant|>\n",
        "d\n",
    ),
    ChatCase(
        "extra keys are ignored",
        [{"role": "user", "content": "x", "name": "n"}, {"role": "assistant", "content": ""}],
        "<|user|>\nx\n<|assistant|>\n",
        "\n",
    ),
]


@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: c.name)
def test_render_messages(case: ChatCase) -> None:
    prompt, completion = render_messages(case.messages)
    assert (prompt, completion) == (case.prompt, case.completion)


@dataclass(frozen=True)
class BadChatCase:
    name: str
    messages: Any
    error: str


BAD_CHAT_CASES = [
    BadChatCase("not a list", {"role": "user"}, "non-empty list of messages, got dict"),
    BadChatCase("missing", None, "non-empty list of messages, got NoneType"),
    BadChatCase("empty", [], "got an empty list"),
    BadChatCase("item not an object", ["hi", {"role": "assistant"}], "message 0 is str"),
    BadChatCase(
        "unknown role",
        [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}],
        "message 0 has role 'tool'",
    ),
    BadChatCase(
        "content not a string",
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
        r"message 1 \(assistant\) content is NoneType",
    ),
    BadChatCase(
        "last message not the assistant",
        [{"role": "user", "content": "x"}],
        "last message is from 'user'",
    ),
]


@pytest.mark.parametrize("case", BAD_CHAT_CASES, ids=lambda c: c.name)
def test_render_messages_rejects_malformed(case: BadChatCase) -> None:
    with pytest.raises(ValueError, match=case.error):
        render_messages(case.messages)
