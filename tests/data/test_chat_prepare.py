"""prepare on chat records: the Dataset artifact holds each chat as the server renders it,
trained on the assistant's turns, with the tokenizer (and its template) the model ships with.

The tokenizers are real (built with the tokenizers library, saved with save_pretrained);
what the server renders is the server's own `_render_chat` on the saved tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from fixtures.llama_chat import BOS, EOT, build_tokenizer, chat_records, documents

from kubellm.data.artifact import load_eval_examples, tokenizer_dir
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.data.records import DataError
from kubellm.data.templates import DEFAULT_CHAT_TEMPLATE
from kubellm.data.tokenizer import EOS, load_tokenizer
from kubellm.serve.model import CausalLMModel

REWRITES_HISTORY = (
    "{{ bos_token }}{% for message in messages %}{{ '<' + message['role'] + '>' }}"
    "{% if message['role'] == 'assistant' and not loop.last %}(earlier answer)"
    "{% else %}{{ message['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _server(tokenizer_path: Path) -> CausalLMModel:
    """The server's chat rendering on a saved tokenizer (what /chat/completions renders)."""
    served = CausalLMModel("chat", tokenizer_path)
    served.tokenizer = load_tokenizer(tokenizer_path)
    return served


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama3-tokenizer")
    build_tokenizer().save_pretrained(out)
    return out


def _prepare(tmp_path: Path, records: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    params = PrepareParams(
        source=str(_write(tmp_path / "chats.jsonl", records)),
        template="messages",
        seq_len=128,
        packing="best_fit",
        progress_s=0,
        **kw,
    )
    return prepare(params, tmp_path / "ds")


@pytest.mark.parametrize("loss", ["all_assistant", "last_assistant"])
def test_training_text_is_what_the_server_renders_plus_the_answer(
    tmp_path: Path, base_tokenizer: Path, loss: str
) -> None:
    records = chat_records(120)
    manifest = _prepare(tmp_path, records, tokenizer=str(base_tokenizer), chat_loss=loss)
    assert manifest["tokenizer"]["chat_template"] == "tokenizer's own"
    tok_dir = tokenizer_dir(tmp_path / "ds")
    tok = load_tokenizer(tok_dir)
    served = _server(tok_dir)
    backend = tok.backend_tokenizer
    expected = {}
    for r in records:
        chat = r["messages"]
        prompt = served._render_chat(chat[:-1])  # what /chat/completions renders
        expected[prompt + chat[-1]["content"] + EOT] = chat
    docs = documents(tmp_path / "ds", tok.convert_tokens_to_ids(BOS))
    assert len(docs) == manifest["records"]["kept"] == len(expected)
    seen = set()
    for ids, mask in docs:
        text = tok.decode(ids)
        chat = expected[text]  # every training text is a rendering the server makes
        seen.add(text)
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        if loss == "last_assistant":
            answers = answers[-1:]
        assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "".join(
            a + EOT for a in answers
        )
        # the last answer is trained after exactly the ids the server feeds the model
        prompt_ids = backend.encode(served._render_chat(chat[:-1]), add_special_tokens=False).ids
        assert ids[: len(prompt_ids)] == prompt_ids
        assert all(mask[len(prompt_ids) :])
    assert seen == set(expected)
    assert manifest["loss_masked_documents"] == len(docs)


def test_held_out_chats_are_evaluation_examples_with_their_messages(
    tmp_path: Path, base_tokenizer: Path
) -> None:
    records = chat_records(200)
    _prepare(tmp_path, records, tokenizer=str(base_tokenizer))
    examples = load_eval_examples(tmp_path / "ds")
    assert examples
    served = _server(tokenizer_dir(tmp_path / "ds"))
    by_history = {json.dumps(r["messages"][:-1]): r["messages"] for r in records}
    for e in examples:
        history = json.loads(e["messages"])
        chat = by_history[json.dumps(history)]
        assert e["prompt"] == served._render_chat(history)
        assert e["completion"] == chat[-1]["content"]


def _single_turn_documents(dataset_dir: Path, eos_id: int) -> list[list[int]]:
    """The documents of a best_fit artifact of one-answer chats in a format without a BOS:
    each ends with its (trained) EOS; a row's padding is its untrained tail."""
    docs = []
    for split in ("train", "val"):
        for row in pq.read_table(dataset_dir / split).to_pylist():
            ids, mask = row["input_ids"], row["loss_mask"]
            start = 0
            for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
                if t == eos_id and m:
                    docs.append(ids[start : i + 1])
                    start = i + 1
    return docs


@pytest.mark.parametrize("base", ["llama3 tokenizer without its template", "trained BPE"])
def test_a_tokenizer_without_a_template_gets_the_default_and_ships_it(
    tmp_path: Path, base: str
) -> None:
    records = chat_records(150, multi_turn_every=0)
    if base == "trained BPE":
        manifest = _prepare(tmp_path, records, vocab_size=300)
        assert manifest["tokenizer"]["kind"] == "byte-level-bpe"
    else:
        bare = build_tokenizer()
        bare.chat_template = None
        bare.save_pretrained(tmp_path / "bare")
        assert not load_tokenizer(tmp_path / "bare").chat_template
        manifest = _prepare(tmp_path, records, tokenizer=str(tmp_path / "bare"))
    assert manifest["tokenizer"]["chat_template"] == "default"
    tok_dir = tokenizer_dir(tmp_path / "ds")
    tok = load_tokenizer(tok_dir)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    served = _server(tok_dir)
    expected = {
        served._render_chat(r["messages"][:-1]) + r["messages"][-1]["content"] + tok.eos_token
        for r in records
    }
    assert all(e.startswith("<|user|>\n") and "\n<|assistant|>\n" in e for e in expected)
    docs = {tok.decode(ids) for ids in _single_turn_documents(tmp_path / "ds", tok.eos_token_id)}
    assert docs == expected
    if base == "trained BPE":
        # the chats' EOS is the special token, not text the BPE spends merges on
        assert not [t for t in tok.get_vocab() if "endof" in t and t != EOS]


def test_prompt_response_records_are_a_user_turn_and_the_answer(
    tmp_path: Path, base_tokenizer: Path
) -> None:
    records = [{"prompt": f"q{i} red?", "response": f"a{i} blue"} for i in range(80)]
    params = PrepareParams(
        source=str(_write(tmp_path / "pr.jsonl", records)),
        template="prompt_response",
        tokenizer=str(base_tokenizer),
        seq_len=128,
        packing="best_fit",
        progress_s=0,
    )
    prepare(params, tmp_path / "ds")
    tok_dir = tokenizer_dir(tmp_path / "ds")
    tok = load_tokenizer(tok_dir)
    served = _server(tok_dir)
    texts = {
        tok.decode(ids) for ids, _ in documents(tmp_path / "ds", tok.convert_tokens_to_ids(BOS))
    }
    assert texts == {
        served._render_chat([{"role": "user", "content": r["prompt"]}]) + r["response"] + EOT
        for r in records
    }


def test_a_template_that_hides_the_assistant_turns_is_a_counted_drop(tmp_path: Path) -> None:
    tok = build_tokenizer(REWRITES_HISTORY)
    tok.save_pretrained(tmp_path / "tok")
    records = chat_records(80, multi_turn_every=2)  # half of them have an earlier answer
    manifest = _prepare(tmp_path, records, tokenizer=str(tmp_path / "tok"))
    multi = sum(1 for r in records if len(r["messages"]) > 2)
    dropped = manifest["records"]["dropped"]
    assert 0 < dropped["bad_template"] <= multi
    assert manifest["records"]["kept"] + sum(dropped.values()) == len(records)
    with pytest.raises(DataError, match=r"chats.jsonl:1: bad template: the chat template does"):
        _prepare(tmp_path, records, tokenizer=str(tmp_path / "tok"), on_error="fail")
