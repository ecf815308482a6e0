"""The OpenAI-compatible routes of the real server, through the official `openai` client."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import requests

from kubellm.serve.client import Endpoint
from kubellm.serve.generate import greedy_with_margins
from serve.compare import assert_same_greedy

PROMPTS = ["12+7=", "3+4=", "100+1=", "45+6="]
CHAT = [{"role": "user", "content": "12+7="}]


@pytest.fixture(scope="module")
def client(server: Endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def _printable_stop(text: str, after: int = 1) -> str | None:
    """A character of `text` (past its first `after`) to use as a stop string."""
    for ch in text[after:]:
        if ch.isprintable() and ch != "\ufffd" and not ch.isspace():
            return ch
    return None


def test_completions_equal_in_process_greedy(
    client: openai.OpenAI, in_process: tuple[Any, Any]
) -> None:
    answers = []
    for prompt in PROMPTS:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert r.object == "text_completion" and r.model == "tiny"
        (choice,) = r.choices
        assert choice.index == 0 and choice.finish_reason in ("stop", "length")
        assert r.usage is not None and r.usage.completion_tokens <= 6
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        answers.append(choice.text.strip())
    expected = greedy_with_margins(*in_process, PROMPTS, 6)
    assert_same_greedy(answers, expected, "completions")
    assert len(set(answers)) > 1, "the tiny model must tell prompts apart"


def test_a_list_of_prompts_gets_one_choice_each(
    client: openai.OpenAI, in_process: tuple[Any, Any]
) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    expected = greedy_with_margins(*in_process, PROMPTS[:3], 4)
    assert_same_greedy([c.text.strip() for c in r.choices], expected, "prompt list")
    assert r.usage is not None and r.usage.completion_tokens <= 12


def test_chat_uses_the_chat_template(client: openai.OpenAI, in_process: tuple[Any, Any]) -> None:
    model, tokenizer = in_process
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>\n")  # the default chat format (data/templates.py)
    expected = greedy_with_margins(model, tokenizer, [prompt], 5)
    assert_same_greedy([(choice.message.content or "").strip()], expected, "chat")
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_streamed_completion_equals_the_whole(client: openai.OpenAI) -> None:
    for prompt in PROMPTS[:2]:
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        chunks = list(
            client.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True
            )
        )
        assert len(chunks) >= 2  # pieces as decoded, then the finish
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streamed_chat_equals_the_whole(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        whole.choices[0].finish_reason
    )
    assert chunks[-1].usage is not None and chunks[-1].usage == whole.usage


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_stop_cuts_before_the_stop_string(client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt="12+7=", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = _printable_stop(text)
    assert stop is not None, f"no printable character to stop at in {text!r}"
    cut = client.completions.create(
        model="tiny", prompt="12+7=", max_tokens=12, temperature=0, stop=[stop, "never-seen"]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt="12+7=", max_tokens=12, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_same_seed_same_sample(client: openai.OpenAI) -> None:
    def sample(seed: int, temperature: float = 1.0, top_p: float = 0.95) -> str:
        r = client.completions.create(
            model="tiny",
            prompt="3+4=",
            max_tokens=12,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        )
        return r.choices[0].text

    assert sample(7) == sample(7)
    hot = {sample(s, temperature=2.0, top_p=1.0) for s in range(4)}
    assert len(hot) > 1, "sampling must depend on the seed"


def test_max_tokens_is_honoured_per_request(client: openai.OpenAI) -> None:
    for n in (1, 3, 7):
        r = client.completions.create(model="tiny", prompt="100+1=", max_tokens=n, temperature=0)
        assert r.usage is not None
        done = r.usage.completion_tokens
        assert done == n if r.choices[0].finish_reason == "length" else done <= n


def test_bad_request_names_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="1+1=", max_tokens=10_000)
    assert "max_tokens" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="1+1=", max_tokens=2)


def test_models_retrieve_and_an_unknown_model(client: openai.OpenAI, server: Endpoint) -> None:
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "kubellm")
    assert model.model_extra == {"max_model_len": 64}  # vLLM's field: the context length
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other")
    assert info.value.body == {
        "message": "the model `other` does not exist",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_health_and_errors_in_the_openai_shape(server: Endpoint) -> None:
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    for method, path, status in [
        ("GET", "/openai/v1/nowhere", 404),
        ("GET", "/openai/v1/completions", 405),
        ("POST", "/openai/v1/models", 405),
    ]:
        r = requests.request(method, server.url + path, timeout=10)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == status


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(
    client: openai.OpenAI, in_process: tuple[Any, Any]
) -> None:
    _, tokenizer = in_process
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    room = 64 - len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == room > 16
    assert r.choices[0].finish_reason == "length"


def test_vllm_sampling_extensions_are_applied(client: openai.OpenAI) -> None:
    """ignore_eos and min_tokens fix a run's length (what load tools ask for); top_k=1 is
    greedy. The engine's own tests check their semantics; this checks they get there."""
    fixed = client.completions.create(
        model="tiny", prompt="1+2=", max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert fixed.usage is not None and fixed.usage.completion_tokens == 9
    floor = client.completions.create(
        model="tiny", prompt="1+2=", max_tokens=9, temperature=0, extra_body={"min_tokens": 9}
    )
    assert floor.usage is not None and floor.usage.completion_tokens == 9
    greedy = client.completions.create(model="tiny", prompt="3+4=", max_tokens=6, temperature=0)
    top1 = client.completions.create(
        model="tiny", prompt="3+4=", max_tokens=6, temperature=1.5, seed=3, extra_body={"top_k": 1}
    )
    assert top1.choices[0].text == greedy.choices[0].text


def test_fields_at_their_defaults_are_accepted(server: Endpoint) -> None:
    body = {
        "model": "tiny",
        "prompt": "1+2=",
        "max_tokens": 2,
        "n": 1,
        "best_of": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": {},
        "stop_token_ids": [],
        "response_format": {"type": "text"},
        "top_k": -1,
        "user": "someone",
        "suffix": None,
        "stop": None,
    }
    r = requests.post(f"{server.url}/openai/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
