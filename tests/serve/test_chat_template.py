"""The server's chat rendering is the exported tokenizer's template, the one prepare trained
with; a model whose tokenizer has none is refused chat.

The server's prompt for `/chat/completions` comes from `CausalLMModel._render_chat`
(`tokenizer.apply_chat_template(..., add_generation_prompt=True)`); training renders with
`kubellm.data.templates.ChatFormat`. Here both run on tokenizers saved the way a dataset and
a model ship them, and a served model (the real `kubellm serve` on a Llama-3-style chat model)
answers a chat as in-process greedy generation from that rendering does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from fixtures.llama_chat import LLAMA3_TEMPLATE, build_model, build_tokenizer, chat_records

from kubellm.data.artifact import tokenizer_dir
from kubellm.data.prepare import PrepareParams, prepare
from kubellm.data.templates import DEFAULT_CHAT_TEMPLATE, ChatFormat
from kubellm.data.tokenizer import load_tokenizer, train_bpe
from kubellm.serve.generate import load_model
from kubellm.serve.model import CausalLMModel
from kubellm.serve.protocol import RequestError
from serve.conftest import kubellm_serve

CHATS = [r["messages"] for r in chat_records(6, seed=5, multi_turn_every=3)]


def _served(path: Path) -> CausalLMModel:
    served = CausalLMModel("chat", path)
    served.tokenizer = load_tokenizer(path)
    return served


@pytest.mark.parametrize("kind", ["llama3 template", "default template (trained BPE)"])
def test_server_renders_what_training_renders(tmp_path: Path, kind: str) -> None:
    if kind == "llama3 template":
        tok = build_tokenizer(LLAMA3_TEMPLATE)
    else:
        tok = train_bpe([m["content"] for c in CHATS for m in c] * 5, vocab_size=300)
    tok.save_pretrained(tmp_path)
    served = _served(tmp_path)
    fmt = ChatFormat.from_tokenizer(load_tokenizer(tmp_path))
    assert fmt.is_default == (kind != "llama3 template")
    for chat in CHATS:
        history = chat[:-1]
        assert served._render_chat(history) == fmt.generation_prompt(history)
        # the training text's last prompt is that rendering, the answer follows it
        segs = fmt.segments(chat)
        last = max(i for i, (_, t) in enumerate(segs) if t)
        assert "".join(s for s, _ in segs[:last]) == served._render_chat(history)


def test_data_without_a_template_ships_none_and_the_server_refuses_chat(tmp_path: Path) -> None:
    """template=none with a base tokenizer that has no chat template: prepare adds none (the
    model never saw a chat), and the server answers chat requests with a 400 naming why."""
    bare = build_tokenizer()
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "bare")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"red blue {i} cat"}) + "\n" for i in range(60)))
    params = PrepareParams(source=str(data), tokenizer=str(tmp_path / "bare"), seq_len=8)
    params.progress_s = 0
    prepare(params, tmp_path / "ds")
    served = _served(tokenizer_dir(tmp_path / "ds"))
    assert not served.tokenizer.chat_template
    with pytest.raises(RequestError, match="has no chat template") as info:
        served._render_chat([{"role": "user", "content": "hi"}])
    assert info.value.field == "messages"
    # with chat data, the same tokenizer is shipped with the default template
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in chat_records(60)))
    params = PrepareParams(source=str(chats), template="messages", tokenizer=str(tmp_path / "bare"))
    params.seq_len, params.progress_s = 64, 0
    prepare(params, tmp_path / "ds2")
    assert _served(tokenizer_dir(tmp_path / "ds2")).tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`kubellm serve` on the Llama-3-style chat model: (OpenAI base URL, model dir)."""
    model_dir = build_model(tmp_path_factory.mktemp("llama-chat"))
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with kubellm_serve(model_dir, "chat", log) as (endpoint, _):
        yield endpoint.openai_url, model_dir


def test_served_chat_is_greedy_generation_from_the_rendered_prompt(
    llama_server: tuple[str, Path],
) -> None:
    base_url, model_dir = llama_server
    model, tok = load_model(model_dir)
    client = openai.OpenAI(base_url=base_url, api_key="none")
    answers, expected = [], []
    for chat in CHATS:
        history = chat[:-1]
        prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        expected.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        r = client.chat.completions.create(
            model="chat", messages=history, max_tokens=6, temperature=0
        )
        answers.append(r.choices[0].message.content)
        assert r.usage is not None and r.usage.prompt_tokens == ids.shape[1]
    assert answers == expected
    assert len(set(expected)) > 1
