"""Chat and instruction records rendered in the model's own chat format, with the loss mask.

Why the tokenizer's template: the server answers `/chat/completions` with
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`, so a model fine-tuned on
text in any other layout is prompted at serving time in a format it never saw. Here a chat
(`messages`, OpenAI format) or a prompt/response pair (a user message and the assistant's
answer) is rendered by the same Jinja template, with the same context (the tokenizer's special
tokens), into the same text; `ChatFormat.render` equals `apply_chat_template(tokenize=False)`
(tests/data/test_chat_format.py holds it to that for several templates).

Which text is trained on (the loss mask) is a list of segments, `(text, trainable)`, that
concatenate to the rendering:

- templates with generation markers (`{% generation %}...{% endgeneration %}`, what
  `return_assistant_tokens_mask` reads): the marked spans, from one rendering;
- other templates (most published ones): for each assistant turn, the rendering of the
  messages before it with `add_generation_prompt=True` must be a prefix of the rendering that
  includes it; the text between is the turn's. A template that renders earlier turns
  differently (one that drops past reasoning, say) fails that check, and the record is
  dropped as `bad_template` with a message saying so, rather than trained on a guess.

`chat_loss` picks the turns: every assistant turn (`all_assistant`, the default) or the last
(`last_assistant`). A trailing EOS token is left out of the text: prepare appends EOS after
every document (and trains on it), so the model learns to stop exactly there.

A tokenizer without a template (the byte-level BPE prepare trains, or a base model that has
none) gets `DEFAULT_CHAT_TEMPLATE`, saved with the tokenizer into the dataset and the exported
model, so serving renders what training did:

    <|system|>\n{content}\n              system and user turns
    <|user|>\n{content}\n
    <|assistant|>\n{content}{eos_token}   assistant turns (the trained part: content + EOS)
    <|assistant|>\n                       the generation prompt

Plain text markers, not special tokens: a BPE trained on the data learns them like any other
text. Rendering must keep up with the tokenizer on short records, so the template is compiled
once per format, and the default one is rendered by plain string joins (`_default_segments`,
held to the Jinja rendering by the tests).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from kubellm.config import ChatLoss

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ROLES",
    "ChatFormat",
    "Segment",
    "check_messages",
    "prompt_response_messages",
]

ROLES = ("system", "user", "assistant")

# The default chat format (see the module docstring); `ChatFormat` renders it without Jinja.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{{- '<|' + message['role'] + '|>\\n' -}}\n"
    "{%- if message['role'] == 'assistant' -%}\n"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}\n"
    "{%- else -%}\n"
    "{{- message['content'] + '\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}\n"
)

Segment = tuple[str, bool]  # a piece of the rendered text; True: a training target
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The chat as the role/content dicts templates take, or ValueError naming the message.

    The server passes templates exactly these two keys (serve.protocol.chat_messages), so
    training does too: extra keys in a record are ignored. `messages` is typed Any because it
    comes straight from untrusted records; the reader reports the error as `bad_template`.
    """
    if not isinstance(messages, list) or not messages:
        kind = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise ValueError(f"messages must be a non-empty list of messages, got {kind}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} is {type(message).__name__}, not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(
                f"message {i} ({role}) content is {type(content).__name__}, not a string"
            )
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "assistant":
        raise ValueError(
            f"the last message is from {out[-1]['role']!r}; it must be the assistant's "
            "answer to train on"
        )
    return out


def prompt_response_messages(prompt: Any, response: Any) -> list[dict[str, str]]:
    """A prompt/response pair as the chat it is: a user message and the assistant's answer."""
    for name, value in (("prompt", prompt), ("response", response)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


class ChatFormat:
    """One chat template, compiled once, with the context `apply_chat_template` gives it.

    `render` is the text the server renders; `segments` is the training text of a chat with
    its loss mask; `example` is a held-out chat as evaluation and the smoke test use it.
    """

    def __init__(
        self,
        template: str = DEFAULT_CHAT_TEMPLATE,
        special_tokens: Mapping[str, Any] | None = None,
        loss: ChatLoss = "all_assistant",
    ) -> None:
        if loss not in ("all_assistant", "last_assistant"):
            raise ValueError(f"chat_loss={loss!r}: allowed 'all_assistant', 'last_assistant'")
        self.template = template
        self.context = dict(special_tokens or {})
        self.loss = loss
        eos = self.context.get("eos_token")
        self.eos = eos if isinstance(eos, str) else ""
        self.is_default = template == DEFAULT_CHAT_TEMPLATE
        if self.is_default and not self.eos:
            raise ValueError("the default chat template needs an eos_token to end the turns")
        self.has_markers = bool(_GENERATION.search(template))
        from transformers.utils.chat_template_utils import _compile_jinja_template

        # transformers' own environment (sandbox, filters, the {% generation %} tag), cached
        # by template: the same compiled template apply_chat_template renders with
        self._compiled = _compile_jinja_template(template)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, loss: ChatLoss = "all_assistant") -> ChatFormat:
        """The tokenizer's own template (the default one when it has none)."""
        template = DEFAULT_CHAT_TEMPLATE
        if getattr(tokenizer, "chat_template", None):
            template = tokenizer.get_chat_template()
        return cls(template, tokenizer.special_tokens_map, loss)

    # -- rendering -------------------------------------------------------------------------

    def render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False
    ) -> str:
        """`tokenizer.apply_chat_template(messages, tokenize=False, ...)`, from role/content
        messages (`check_messages`)."""
        if self.is_default:
            text = "".join(self._default_pieces(messages, all_trained=True)[0])
            return text + "<|assistant|>\n" if add_generation_prompt else text
        return str(self._render(list(messages), add_generation_prompt))

    def _render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        return str(
            self._compiled.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.context,
            )
        )

    def generation_prompt(self, messages: Sequence[Mapping[str, str]]) -> str:
        """What the server renders for a request of `messages` (the assistant's turn opened)."""
        return self.render(messages, add_generation_prompt=True)

    def segments(self, messages: Any) -> tuple[Segment, ...]:
        """The training text of a chat as consecutive (text, trainable) pieces.

        Raises ValueError (reported as `bad_template`) for a malformed chat, and for a
        template whose assistant turns cannot be told apart from the rest (see the module
        docstring).
        """
        return self.checked_segments(check_messages(messages))

    def checked_segments(self, chat: list[dict[str, str]]) -> tuple[Segment, ...]:
        """`segments` of a chat `check_messages` has returned."""
        if self.is_default:
            return self._default_segments(chat)
        segs = self._marked(chat) if self.has_markers else self._by_prefix(chat)
        return self._without_final_eos(segs)

    def example(self, messages: Sequence[Mapping[str, str]]) -> dict[str, str]:
        """A held-out chat as an evaluation example: the prompt the server renders for the
        chat before its last answer, the answer (stripped, as generated answers are
        compared), and those earlier messages as JSON, for a /chat/completions request."""
        import json

        history = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
        return {
            "prompt": self.generation_prompt(history),
            "completion": messages[-1]["content"].strip(),
            "messages": json.dumps(history, ensure_ascii=False),
        }

    # -- how the assistant's text is found -------------------------------------------------

    def _trained(self, chat: list[dict[str, str]]) -> list[int]:
        turns = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        return turns if self.loss == "all_assistant" else turns[-1:]

    def _default_segments(self, chat: list[dict[str, str]]) -> tuple[Segment, ...]:
        """`checked_segments` in the default format, by string joins: a few microseconds a
        chat (tests/data/test_templates.py holds it to the Jinja template's rendering)."""
        eos, every = self.eos, self.loss == "all_assistant"
        last = len(chat) - 1
        segs: list[Segment] = []
        untrained: list[str] = []
        for i, m in enumerate(chat):
            role, content = m["role"], m["content"]
            if role != "assistant":
                untrained += ("<|", role, "|>\n", content, "\n")
            elif every or i == last:
                untrained.append("<|assistant|>\n")
                segs.append(("".join(untrained), False))
                untrained = []
                if i < last:
                    segs.append((content + eos, True))
                elif content:  # the final EOS is prepare's to append
                    segs.append((content, True))
            else:
                untrained += ("<|assistant|>\n", content, eos)
        return tuple(segs)

    def _default_pieces(
        self, chat: Sequence[Mapping[str, str]], all_trained: bool
    ) -> tuple[list[str], list[bool]]:
        """The default template's text in pieces, and which pieces are trained."""
        last = len(chat) - 1
        pieces: list[str] = []
        trained: list[bool] = []
        for i, m in enumerate(chat):
            role, content = m["role"], m["content"]
            pieces.append(f"<|{role}|>\n")
            trained.append(False)
            if role == "assistant":
                pieces.append(content + self.eos)
                trained.append(all_trained or self.loss == "all_assistant" or i == last)
            else:
                pieces.append(content + "\n")
                trained.append(False)
        return pieces, trained

    def _marked(self, chat: list[dict[str, str]]) -> list[Segment]:
        """Spans the template's {% generation %} blocks mark, from one rendering."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        env: Any = self._compiled.environment
        with env.activate_tracker(blocks, spans):
            for block in self._compiled.generate(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=False,
                **self.context,
            ):
                blocks.append(block)
        text = "".join(blocks)
        if not spans:
            raise ValueError(
                "the chat template's {% generation %} blocks marked no text of this chat"
            )
        if self.loss == "last_assistant":
            spans = spans[-1:]
        return _split(text, spans)

    def _by_prefix(self, chat: list[dict[str, str]]) -> list[Segment]:
        """Each trained turn is what its rendering adds to the generation prompt before it."""
        full = self._render(chat, False)
        spans: list[tuple[int, int]] = []
        last = len(chat) - 1
        for i in self._trained(chat):
            opened = self._render(chat[:i], True)
            closed = full if i == last else self._render(chat[: i + 1], False)
            start = len(opened)
            if not (closed.startswith(opened) and full.startswith(closed)) or (
                spans and start < spans[-1][1]
            ):
                raise ValueError(
                    f"the chat template does not render message {i} (assistant) as an extension "
                    f"of the {i} message(s) before it (their rendering with "
                    "add_generation_prompt=True is not a prefix of the chat's), so its tokens "
                    "cannot be told from the prompt's; use a template with {% generation %} "
                    "markers, or chat_loss=last_assistant if only earlier turns differ"
                )
            spans.append((start, len(closed)))
        return _split(full, spans)

    def _without_final_eos(self, segs: list[Segment]) -> tuple[Segment, ...]:
        """The chat without its final EOS token: prepare appends one (trained) to every
        document, so keeping the template's would train the model to stop twice."""
        if self.eos and segs and segs[-1][1] and segs[-1][0].endswith(self.eos):
            text = segs[-1][0][: -len(self.eos)]
            segs = [*segs[:-1], (text, True)] if text else segs[:-1]
        return tuple(segs)


def _split(text: str, spans: list[tuple[int, int]]) -> list[Segment]:
    """`text` cut at the trained `spans` (sorted, disjoint) into (piece, trained) segments."""
    segs: list[Segment] = []
    pos = 0
    for start, end in spans:
        if start > pos:
            segs.append((text[pos:start], False))
        if end > start:
            segs.append((text[start:end], True))
        pos = max(pos, end)
    if pos < len(text):
        segs.append((text[pos:], False))
    return segs


def _merge(pieces: list[str], trained: list[bool]) -> list[Segment]:
    """Adjacent pieces with the same flag joined; empty pieces dropped."""
    segs: list[Segment] = []
    run: list[str] = []
    flag = False
    for piece, t in zip(pieces, trained, strict=True):
        if not piece:
            continue
        if run and t != flag:
            segs.append(("".join(run), flag))
            run = []
        flag = t
        run.append(piece)
    if run:
        segs.append(("".join(run), flag))
    return segs
