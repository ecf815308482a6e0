"""Chat tasks for evaluation (kubellm.evaluate.tasks): a chat in `eval_data` is asked as the
server would be asked it, in the model's own format, and again in another model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.llama_chat import LLAMA3_TEMPLATE, build_tokenizer, chat_records

from kubellm.data.records import DataError
from kubellm.data.templates import ChatFormat
from kubellm.data.tokenizer import train_bpe
from kubellm.evaluate.tasks import for_model, load_task


def _task(tmp_path: Path, rows: list[dict[str, object]]) -> str:
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_records_are_rendered_in_the_model_format(tmp_path: Path) -> None:
    tok = build_tokenizer(LLAMA3_TEMPLATE)
    chats = chat_records(5, multi_turn_every=2)
    uri = _task(tmp_path, [*chats, {"prompt": "1+1=", "answer": "2"}])
    examples = load_task(uri, chat=ChatFormat.from_tokenizer(tok))
    assert len(examples) == 6
    for e, r in zip(examples, chats, strict=False):
        history = r["messages"][:-1]
        assert e["prompt"] == tok.apply_chat_template(
            history, tokenize=False, add_generation_prompt=True
        )
        assert e["completion"] == r["messages"][-1]["content"]
        assert json.loads(e["messages"]) == history
    assert examples[-1] == {"prompt": "1+1=", "completion": "2"}

    # a champion with another format is asked the same chats its own way
    other = train_bpe(["red blue"] * 10, vocab_size=300)
    again = for_model(examples, ChatFormat.from_tokenizer(other))
    for e, r in zip(again, chats, strict=False):
        assert e["prompt"] == other.apply_chat_template(
            r["messages"][:-1], tokenize=False, add_generation_prompt=True
        )
        assert e["prompt"].endswith("<|assistant|>\n")
    assert again[-1] == examples[-1]
    with pytest.raises(DataError, match="the model has no chat template"):
        for_model(examples, None)


def test_chat_tasks_need_the_template_and_a_well_formed_chat(tmp_path: Path) -> None:
    uri = _task(tmp_path, chat_records(1))
    with pytest.raises(
        DataError, match=r"task.jsonl:1: a chat \(messages\) is asked in the model.s chat"
    ):
        load_task(uri)
    bad = _task(tmp_path, [{"messages": [{"role": "user", "content": "no answer"}]}])
    fmt = ChatFormat.from_tokenizer(build_tokenizer())
    with pytest.raises(DataError, match=r"task\.jsonl:1: the last message is from 'user'"):
        load_task(bad, chat=fmt)
