"""Templates that turn instruction and chat records into text with a prompt/completion split.

Why a split and not just text: prepare_data masks the loss on the prompt part when asked, so the
model learns to answer rather than to repeat questions. Each renderer returns the two parts
exactly, so `prompt + completion` is the training text and the boundary is known in characters.

The formats are deliberately plain (no special tokens the tokenizer must know): a byte-level BPE
trained on the data learns the headers like any other text, and serving renders prompts with the
same functions so training and inference see the same layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant")

RESPONSE_HEADER = "### Response:\n"


def render_prompt_response(prompt: str, response: str) -> tuple[str, str]:
    """(prompt part, completion part) for an instruction/response pair (Alpaca-style headers).

    The response header ends the prompt part, so at inference the model is asked to continue
    right after it, exactly where training started counting the loss.
    """
    for name, value in (("prompt", prompt), ("response", response)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return f"### Instruction:\n{prompt}\n\n{RESPONSE_HEADER}", response


def render_messages(messages: Any) -> tuple[str, str]:
    """(prompt part, completion part) for a chat: `<|role|>\\ncontent\\n` per message.

    The completion is the final assistant turn only; earlier assistant turns belong to the
    prompt (context the model is given, not asked to produce), and the final `<|assistant|>\\n`
    header closes the prompt so inference can stop there and let the model answer. The trailing
    newline of the answer is part of the completion: it is how the model learns to end a turn.

    Raises ValueError with a message naming the offending message, which the reader reports as
    `bad_template`. `messages` is typed Any because it comes straight from untrusted records.
    """
    if not isinstance(messages, list) or not messages:
        kind = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise ValueError(f"messages must be a non-empty list of messages, got {kind}")
    parts: list[str] = []
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
        parts.append(f"<|{role}|>\n{content}\n")
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"the last message is from {messages[-1]['role']!r}; it must be the assistant's "
            "answer to train on"
        )
    answer = messages[-1]["content"]
    prompt = "".join(parts[:-1]) + "<|assistant|>\n"
    return prompt, answer + "\n"
