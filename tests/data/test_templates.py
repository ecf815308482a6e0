"""The default chat format: the exact text a model trains on, and which of it is trained.

Tokenizers with their own templates are in test_chat_format.py; here the default format
(what the byte-level BPE is saved with), its fast path held to its Jinja template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kubellm.data.templates import (
    DEFAULT_CHAT_TEMPLATE,
    ChatFormat,
    check_messages,
    prompt_response_messages,
)
from kubellm.data.tokenizer import EOS

SPECIAL = {"bos_token": EOS, "eos_token": EOS, "pad_token": "<|pad|>"}


def _fmt(loss: Any = "all_assistant") -> ChatFormat:
    return ChatFormat(DEFAULT_CHAT_TEMPLATE, SPECIAL, loss)


def test_prompt_response_is_a_user_message_and_the_answer() -> None:
    chat = prompt_response_messages("Add 2 and 3.", "5")
    assert _fmt().segments(chat) == (
        ("<|user|>\nAdd 2 and 3.\n<|assistant|>\n", False),
        ("5", True),
    )


def test_prompt_response_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match="response must be a string, got int"):
        prompt_response_messages("q", 3)


@dataclass(frozen=True)
class ChatCase:
    name: str
    messages: list[dict[str, str]]
    segments: tuple[tuple[str, bool], ...]  # chat_loss=all_assistant
    last_only: tuple[tuple[str, bool], ...] | None = None  # chat_loss=last_assistant, if other


E = EOS
CHAT_CASES = [
    ChatCase(
        "one turn: the final EOS is left to prepare, which appends it",
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        (("<|user|>\nhi\n<|assistant|>\n", False), ("hello", True)),
    ),
    ChatCase(
        "system prompt",
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        (("<|system|>\nbe brief\n<|user|>\n2+2?\n<|assistant|>\n", False), ("4", True)),
    ),
    ChatCase(
        "every assistant turn is trained, each ending with EOS",
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ],
        (
            ("<|user|>\na\n<|assistant|>\n", False),
            (f"b{E}", True),
            ("<|user|>\nc\n<|assistant|>\n", False),
            ("d", True),
        ),
        (
            ("<|user|>\na\n<|assistant|>\nb" + E + "<|user|>\nc\n<|assistant|>\n", False),
            ("d", True),
        ),
    ),
    ChatCase(
        "extra keys are ignored; an empty answer trains only the EOS",
        [{"role": "user", "content": "x", "name": "n"}, {"role": "assistant", "content": ""}],
        (("<|user|>\nx\n<|assistant|>\n", False),),
    ),
]


@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: c.name)
def test_default_format_segments(case: ChatCase) -> None:
    assert _fmt().segments(case.messages) == case.segments
    last = _fmt("last_assistant").segments(case.messages)
    assert last == (case.last_only or case.segments)


@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: c.name)
def test_default_fast_path_renders_what_its_jinja_template_renders(case: ChatCase) -> None:
    """The default format is rendered by string joins; the template saved with the tokenizer
    (what the server renders) is Jinja. Both ways of finding the trained text agree too."""
    chat = check_messages(case.messages)
    for loss in ("all_assistant", "last_assistant"):
        fast = _fmt(loss)
        jinja = _fmt(loss)
        jinja.is_default = False  # the Jinja template, through its {% generation %} markers
        assert jinja.has_markers
        for history in (chat, chat[:-1], chat[:1]):
            for opened in (False, True):
                want = jinja._render(history, opened)
                assert fast.render(history, opened) == want
        marked = jinja.checked_segments(chat)
        jinja.has_markers = False  # the prefix rule (templates without markers)
        assert fast.checked_segments(chat) == marked == jinja.checked_segments(chat)
        assert "".join(s for s, _ in marked) + E == jinja._render(chat, False)


def test_default_format_needs_an_eos() -> None:
    with pytest.raises(ValueError, match="needs an eos_token"):
        ChatFormat(DEFAULT_CHAT_TEMPLATE, {})


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
def test_malformed_chats_are_refused(case: BadChatCase) -> None:
    with pytest.raises(ValueError, match=case.error):
        _fmt().segments(case.messages)
