"""End to end: LoRA fine-tune of a pretrained-like chat model on chat records, through the
whole local pipeline (`kubellm run --local`), trained and served in the model's own format.

The base model is a tiny Llama with a Llama-3-style tokenizer and chat template
(tests/fixtures/llama_chat.py), saved with save_pretrained; the run is the batch's `chat`
run (tests/e2e/conftest.py: CHAT_RUN). Two equalities:

(a) the served `/chat/completions` answer (the local model server the pipeline deploys,
    asked with the openai client) equals transformers' greedy generation, in-process, from
    `apply_chat_template(add_generation_prompt=True)` with the exported model;
(b) every record's training text, read back from the Dataset artifact, equals what the
    server renders for its prompt plus the answer (and the tokens trained on are the
    assistant's).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from fixtures.llama_chat import BOS, EOT, documents

from kubellm.backends.base import ServeRequest
from kubellm.backends.local.model_server import LocalModelServer
from kubellm.serve.generate import load_model
from kubellm.serve.model import CausalLMModel

from .conftest import Batch, LocalRun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
MAX_TOKENS = 6


def _run_dir(run: LocalRun) -> Path:
    [run_dir] = (run.tmp / "runs" / "kfp").glob("kubellm-llm-train-*")
    return run_dir


def _records(run: LocalRun) -> list[list[dict[str, str]]]:
    lines = (run.tmp / "chats.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines]


@pytest.fixture(scope="module")
def chat_run(batch: Batch) -> LocalRun:
    run = batch.result("chat")
    assert run.proc.returncode == 0, run.proc.stdout[-4000:] + run.proc.stderr[-4000:]
    return run


@pytest.mark.pipeline_runs("chat")
def test_the_chat_finetune_succeeds_and_smoke_tests_on_the_chat_route(chat_run: LocalRun) -> None:
    out = chat_run.proc.stdout
    summary = out[out.rindex("=" * 78) :]
    assert ": SUCCEEDED" in summary and "pipeline succeeded" in summary
    assert "kubellm: tune done in" in out and "skipped" in out
    # the smoke test asked the deployed server on the chat completions route, and its
    # answers were evaluate's (in-process greedy on the prompts prepare rendered)
    smoke = re.search(r"agreement (\d+)/(\d+) \((\d+) on the chat completions route\)", out)
    assert smoke, out[-3000:]
    same, n, chats = map(int, smoke.groups())
    assert same == n == chats > 0
    manifest = json.loads((_run_dir(chat_run) / "prepare-data/dataset/manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "pretrained"
    assert manifest["tokenizer"]["chat_template"] == "tokenizer's own"
    assert manifest["params"]["template"] == "messages"


@pytest.mark.pipeline_runs("chat")
def test_training_text_is_the_served_prompt_plus_the_answer(chat_run: LocalRun) -> None:
    """(b): decoded from the Dataset artifact, each document is the server's rendering of
    its record's prompt (CausalLMModel._render_chat, on the exported tokenizer) plus the
    answer; the tokens trained on are the assistant turns; the last answer follows exactly
    the ids the server feeds the model."""
    run_dir = _run_dir(chat_run)
    model_dir = run_dir / "train" / "model"
    served = CausalLMModel("chat", model_dir)
    _, served.tokenizer = load_model(model_dir)
    tok = served.tokenizer
    backend = tok.backend_tokenizer
    expected = {}
    for chat in _records(chat_run):
        expected[served._render_chat(chat[:-1]) + chat[-1]["content"] + EOT] = chat
    docs = documents(run_dir / "prepare-data" / "dataset", tok.convert_tokens_to_ids(BOS))
    manifest = json.loads((run_dir / "prepare-data/dataset/manifest.json").read_text())
    assert len(docs) == manifest["records"]["kept"] == len(expected)
    texts = set()
    for ids, mask in docs:
        text = tok.decode(ids)
        chat = expected[text]
        texts.add(text)
        answers = [m["content"] + EOT for m in chat if m["role"] == "assistant"]
        assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "".join(answers)
        prompt_ids = backend.encode(served._render_chat(chat[:-1]), add_special_tokens=False).ids
        assert ids[: len(prompt_ids)] == prompt_ids and all(mask[len(prompt_ids) :])
    assert texts == set(expected)
    assert any(len(chat) > 2 for chat in expected.values())  # multi-turn chats among them


@pytest.mark.pipeline_runs("chat")
def test_served_chat_answer_is_in_process_generation(chat_run: LocalRun) -> None:
    """(a): the exported model, served by the pipeline's local model server and asked with
    the openai client, answers each held-out chat as transformers' greedy generate does
    from the same rendered prompt."""
    run_dir = _run_dir(chat_run)
    model_dir = run_dir / "train" / "model"
    predictions = json.loads((run_dir / "evaluate" / "predictions").read_text())
    histories = [json.loads(p["messages"]) for p in predictions][:8]
    assert any(len(h) > 1 for h in histories) or len(histories) >= 4
    model, tok = load_model(model_dir)
    expected = []
    for history in histories:
        prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id
            )
        expected.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    server = LocalModelServer(chat_run.tmp / "equality-server")
    rollout = server.deploy(ServeRequest(name="chat", model_uri=str(model_dir), timeout_s=300))
    try:
        client = openai.OpenAI(base_url=rollout.endpoint.openai_url, api_key="none")
        answers: list[Any] = []
        for history in histories:
            r = client.chat.completions.create(
                model="chat", messages=history, max_tokens=MAX_TOKENS, temperature=0
            )
            answers.append(r.choices[0].message.content)
    finally:
        server.delete("chat")
    assert answers == expected
    assert len(set(expected)) > 1  # the prompts are told apart
