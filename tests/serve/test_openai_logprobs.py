"""Log-probabilities through the official `openai` client, against the model in-process:
what lm-evaluation-harness's loglikelihood requests (`local-completions`: token-id prompts,
echo, logprobs) and chat clients read."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
import torch

from kubellm.serve.client import Endpoint

PROMPT = "12+7=19"
TOL = 1e-4


@pytest.fixture(scope="module")
def client(server: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def log_softmax(in_process: tuple[Any, Any], ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row j is the distribution of the token after ids[: j + 1]."""
    model, _ = in_process
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_echo_scores_each_prompt_token(client: openai.OpenAI, in_process: tuple[Any, Any]) -> None:
    _, tokenizer = in_process
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    r = client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    (choice,) = r.choices
    assert choice.text == PROMPT and r.usage is not None and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = log_softmax(in_process, ids)
    for j in range(1, len(ids)):
        want = float(expected[j - 1, ids[j]])
        got = lp.token_logprobs[j]
        assert got is not None and math.isclose(got, want, abs_tol=TOL), (j, got, want)
        top = lp.top_logprobs[j]
        assert top is not None and lp.tokens[j] in top  # k=1 and the token itself
        best = int(expected[j - 1].argmax())
        assert math.isclose(
            top[tokenizer.decode([best])], float(expected[j - 1, best]), abs_tol=TOL
        )
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)


def test_a_token_id_prompt_answers_as_its_text(
    client: openai.OpenAI, in_process: tuple[Any, Any]
) -> None:
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs=1 and
    max_tokens=1; it reads token_logprobs[ctxlen:-1] and whether each was the top one."""
    _, tokenizer = in_process
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    asked: dict[str, Any] = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    text = client.completions.create(model="tiny", prompt=PROMPT, **asked).choices[0]
    as_ids = client.completions.create(model="tiny", prompt=ids, **asked).choices[0]
    batch = client.completions.create(model="tiny", prompt=[ids, ids[:3]], **asked).choices
    assert as_ids.text == text.text and as_ids.logprobs == text.logprobs
    assert len(batch) == 2 and batch[0].text == text.text
    assert batch[0].logprobs is not None and text.logprobs is not None
    # a batch pads its rows: the same numbers, to the last bits
    assert batch[0].logprobs.tokens == text.logprobs.tokens
    batched, alone = batch[0].logprobs.token_logprobs, text.logprobs.token_logprobs
    for a, b in zip(batched or [], alone or [], strict=True):
        assert (a is None and b is None) or math.isclose(a or 0.0, b or 0.0, abs_tol=TOL)
    lp = text.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt's tokens, then the new one
    expected = log_softmax(in_process, ids)
    new = float(expected[-1].max())  # greedy: the most likely next token
    assert math.isclose(lp.token_logprobs[-1] or 0.0, new, abs_tol=TOL)
    greedy = [
        tok == max(top.values())
        for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
        if tok is not None and top is not None
    ]
    assert greedy[-1], "the generated token is the greedy one"


def test_generated_tokens_carry_logprobs(
    client: openai.OpenAI, in_process: tuple[Any, Any]
) -> None:
    _, tokenizer = in_process
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    r = client.completions.create(
        model="tiny", prompt=PROMPT, logprobs=3, max_tokens=4, temperature=0
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert r.usage is not None and len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(top is not None and 1 <= len(top) <= 4 for top in lp.top_logprobs)
    first = float(log_softmax(in_process, ids)[-1].max())
    assert math.isclose(lp.token_logprobs[0] or 0.0, first, abs_tol=TOL)


def test_chat_logprobs_in_the_chat_shape(
    client: openai.OpenAI, in_process: tuple[Any, Any]
) -> None:
    _, tokenizer = in_process
    messages = [{"role": "user", "content": "12+7="}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    (choice,) = r.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert r.usage is not None and len(content) == r.usage.completion_tokens
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=TOL)  # greedy
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    first = float(log_softmax(in_process, ids)[-1].max())
    assert math.isclose(content[0].logprob, first, abs_tol=TOL)
