"""ChatFormat against real tokenizers: the text `apply_chat_template` renders, and which of it
is trained (generation markers, or the prefix rule for templates without them).

Each tokenizer is built with the tokenizers library and saved with save_pretrained, then
loaded as prepare loads a base model's (kubellm.data.tokenizer.load_tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fixtures.llama_chat import (
    LLAMA3_MARKED_TEMPLATE,
    LLAMA3_TEMPLATE,
    build_tokenizer,
    chat_records,
)

from kubellm.data.templates import DEFAULT_CHAT_TEMPLATE, ChatFormat, check_messages
from kubellm.data.tokenizer import load_tokenizer, train_bpe

# ChatML (Qwen's format): the turn's end is followed by a newline the prefix rule trains too
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Renders earlier assistant turns differently from the last one (as templates that drop past
# reasoning do): the prefix rule cannot find those turns' text
REWRITES_HISTORY = (
    "{% for message in messages %}{{ '<' + message['role'] + '>' }}"
    "{% if message['role'] == 'assistant' and not loop.last %}(earlier answer)"
    "{% else %}{{ message['content'] }}{% endif %}{{ '</>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)

SYSTEM = {"role": "system", "content": "be brief"}
CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
    [SYSTEM, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " 4 "}],
    [
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "b a"},
        {"role": "user", "content": "c d e"},
        {"role": "assistant", "content": "e d c"},
    ],
    *[r["messages"] for r in chat_records(4, seed=3, multi_turn_every=2)],
]


@dataclass(frozen=True)
class TokCase:
    name: str
    template: str | None  # None: the byte-level BPE prepare trains (the default template)
    markers: bool


TOKENIZERS = [
    TokCase("llama3 (no markers: the prefix rule)", LLAMA3_TEMPLATE, False),
    TokCase("llama3 with generation markers", LLAMA3_MARKED_TEMPLATE, True),
    TokCase("chatml", CHATML_TEMPLATE, False),
    TokCase("byte-level BPE, default template", None, True),
]


def _saved(tmp_path: Path, case: TokCase) -> Any:
    if case.template is None:
        texts = [m["content"] for chat in CHATS for m in chat]
        tok = train_bpe(texts * 3, vocab_size=300)
        assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    else:
        tok = build_tokenizer(case.template)
    tok.save_pretrained(tmp_path / "tok")
    return load_tokenizer(tmp_path / "tok")


@pytest.mark.parametrize("case", TOKENIZERS, ids=lambda c: c.name)
def test_render_is_apply_chat_template(tmp_path: Path, case: TokCase) -> None:
    tok = _saved(tmp_path, case)
    fmt = ChatFormat.from_tokenizer(tok)
    assert fmt.has_markers == case.markers
    assert fmt.is_default == (case.template is None)
    for chat in CHATS:
        for history in (chat, chat[:-1], chat[:1]):
            for opened in (False, True):
                want = tok.apply_chat_template(
                    history, tokenize=False, add_generation_prompt=opened
                )
                assert fmt.render(history, opened) == want, (history, opened)
        example = fmt.example(chat)
        want = tok.apply_chat_template(chat[:-1], tokenize=False, add_generation_prompt=True)
        assert example["prompt"] == want
        assert example["completion"] == chat[-1]["content"].strip()


def _trained(segs: tuple[tuple[str, bool], ...]) -> list[str]:
    return [s for s, t in segs if t]


@pytest.mark.parametrize("case", TOKENIZERS, ids=lambda c: c.name)
def test_segments_are_the_rendering_with_the_assistant_turns_trained(
    tmp_path: Path, case: TokCase
) -> None:
    tok = _saved(tmp_path, case)
    for loss in ("all_assistant", "last_assistant"):
        fmt = ChatFormat.from_tokenizer(tok, loss)  # type: ignore[arg-type]
        for chat in CHATS:
            segs = fmt.segments(chat)
            full = tok.apply_chat_template(chat, tokenize=False)
            text = "".join(s for s, _ in segs)
            # the final EOS is left to prepare (which appends it, trained)
            assert full in (text, text + tok.eos_token)
            assert all(s for s, _ in segs)  # no empty pieces
            answers = [m["content"] for m in chat if m["role"] == "assistant"]
            if loss == "last_assistant":
                answers = answers[-1:]
            trained = _trained(segs)
            assert len(trained) == len(answers)
            for piece, answer in zip(trained, answers, strict=True):
                body = answer.strip() if case.template and "trim" in case.template else answer
                assert piece.startswith(body)  # the answer, then the template's turn end
                end = piece[len(body) :]
                assert end in ("", tok.eos_token, "<|im_end|>\n"), end
            # the prompt of the last turn is what the server renders for the chat before it
            last = max(i for i, (_, t) in enumerate(segs) if t)
            prompt = "".join(s for s, _ in segs[:last])
            assert prompt == tok.apply_chat_template(
                chat[:-1], tokenize=False, add_generation_prompt=True
            )


def test_markers_and_prefix_rule_agree(tmp_path: Path) -> None:
    for loss in ("all_assistant", "last_assistant"):
        plain = ChatFormat.from_tokenizer(build_tokenizer(LLAMA3_TEMPLATE), loss)  # type: ignore[arg-type]
        marked = ChatFormat.from_tokenizer(build_tokenizer(LLAMA3_MARKED_TEMPLATE), loss)  # type: ignore[arg-type]
        assert marked.has_markers and not plain.has_markers
        for chat in CHATS:
            assert plain.segments(chat) == marked.segments(chat)


def test_marked_mask_is_return_assistant_tokens_mask(tmp_path: Path) -> None:
    """The tokens prepare trains on (each piece encoded, then the EOS it appends) are the
    ones transformers' return_assistant_tokens_mask marks, and the last turn's prompt is
    encoded as the server encodes the prompt it renders. With Llama 3's pre-tokenizer split
    the pieces' ids are the whole rendering's too (a GPT-2 split would merge a header's
    "\n\n" at the end of a prompt and split it before a word: pieces keep the server's)."""
    tok = _saved(tmp_path, TOKENIZERS[1])
    fmt = ChatFormat.from_tokenizer(tok)
    backend = tok.backend_tokenizer
    for chat in CHATS:
        out = tok.apply_chat_template(
            chat, return_dict=True, return_assistant_tokens_mask=True, tokenize=True
        )
        theirs = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
        ids: list[int] = []
        ours: list[int] = []
        n_prompt = 0
        for piece, trained in fmt.segments(chat):
            piece_ids = backend.encode(piece, add_special_tokens=False).ids
            if trained:
                ours += piece_ids
                n_prompt = len(ids)
            ids += piece_ids
        assert [*ours, tok.eos_token_id] == theirs
        served = fmt.generation_prompt(chat[:-1])
        assert ids[:n_prompt] == backend.encode(served, add_special_tokens=False).ids
        assert [*ids, tok.eos_token_id] == out["input_ids"]


def test_a_template_that_rewrites_history_is_refused_with_the_reason() -> None:
    tok = build_tokenizer(REWRITES_HISTORY)
    multi = CHATS[2]
    with pytest.raises(ValueError, match=r"does not render message 1 \(assistant\) as an"):
        ChatFormat.from_tokenizer(tok).segments(multi)
    # the last turn alone is still found: earlier turns are rendered the same in both
    segs = ChatFormat.from_tokenizer(tok, "last_assistant").segments(multi)
    assert _trained(segs) == ["e d c</>"]
    # single-turn chats have no history to rewrite
    assert _trained(ChatFormat.from_tokenizer(tok).segments(CHATS[0])) == ["hello there</>"]


def test_chat_loss_is_checked() -> None:
    with pytest.raises(ValueError, match="chat_loss='first'"):
        ChatFormat(LLAMA3_TEMPLATE, {}, "first")  # type: ignore[arg-type]


def test_messages_are_passed_as_the_server_passes_them() -> None:
    """Only role and content reach the template, as serve.protocol.chat_messages sends."""
    chat = [{"role": "user", "content": "x", "name": "bob", "extra": 1}, CHATS[0][1]]
    assert check_messages(chat) == [{"role": "user", "content": "x"}, CHATS[0][1]]
    tok = build_tokenizer("{% for m in messages %}{{ m | tojson }}{% endfor %}")
    fmt = ChatFormat.from_tokenizer(tok)
    clean = check_messages(chat)
    assert fmt.render(clean) == tok.apply_chat_template(clean, tokenize=False)
    assert "bob" not in fmt.render(clean)
