"""The model behind the server, in-process: payload parsing, greedy completion, loading."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kserve.errors import InvalidInput

from kubellm.serve.generate import complete, greedy_with_margins, load_model
from kubellm.serve.model import MAX_INSTANCES, CausalLMModel, Instance, parse_instances
from kubellm.serve.protocol import ChatCompletionRequest, RequestError
from serve.compare import assert_same_greedy

# Same token length (digits are one token each), so `complete` puts them in one batch.
SAME_LENGTH = ["12+7=", "45+6=", "99+1=", "30+5="]


@dataclass(frozen=True)
class Case:
    name: str
    payload: Any
    prompts: list[str] | None = None  # expected prompts on success
    max_new: list[int] | None = None  # expected max_new_tokens of each instance on success
    error: str | None = None  # substring of the InvalidInput message on failure


CASES = [
    Case("strings", {"instances": ["1+2=", "3+4="]}, ["1+2=", "3+4="], [8, 8]),
    Case("dict default", {"instances": [{"prompt": "1+2="}]}, ["1+2="], [8]),
    Case("dict with max", {"instances": [{"prompt": "a", "max_new_tokens": 3}]}, ["a"], [3]),
    Case("lower bound", {"instances": [{"prompt": "a", "max_new_tokens": 1}]}, ["a"], [1]),
    Case(
        "no upper bound but the context's",
        {"instances": [{"prompt": "a", "max_new_tokens": 10_000}]},
        ["a"],
        [10_000],
    ),
    Case(
        "each keeps its own max",
        {"instances": [{"prompt": "a", "max_new_tokens": 3}, {"prompt": "b", "max_new_tokens": 5}]},
        ["a", "b"],
        [3, 5],
    ),
    Case(
        "each keeps its own max, reversed",
        {"instances": [{"prompt": "a", "max_new_tokens": 5}, {"prompt": "b", "max_new_tokens": 3}]},
        ["a", "b"],
        [5, 3],
    ),
    Case("max instances", {"instances": ["x"] * MAX_INSTANCES}, ["x"] * MAX_INSTANCES, [8] * 256),
    Case("empty prompt", {"instances": [""]}, error="instances[0].prompt is empty"),
    Case(
        "empty prompt in a dict",
        {"instances": ["a", {"prompt": "", "max_new_tokens": 3}]},
        error="instances[1].prompt is empty",
    ),
    Case("not an object", ["1+2="], error='"instances" list'),
    Case("no instances key", {"inputs": ["1+2="]}, error='"instances" list'),
    Case("instances not a list", {"instances": "1+2="}, error='"instances" list'),
    Case("empty list", {"instances": []}, error=f"1 to {MAX_INSTANCES} items"),
    Case("too many", {"instances": ["x"] * (MAX_INSTANCES + 1)}, error=f"1 to {MAX_INSTANCES}"),
    Case("missing prompt", {"instances": ["ok", {"text": "a"}]}, error="instances[1] must be"),
    Case("prompt not a string", {"instances": [{"prompt": 7}]}, error='string "prompt"'),
    Case("instance a number", {"instances": [3]}, error="instances[0] must be a string"),
    Case(
        "max_new_tokens zero",
        {"instances": [{"prompt": "a", "max_new_tokens": 0}]},
        error="instances[0].max_new_tokens must be an integer >= 1",
    ),
    Case(
        "max_new_tokens a string",
        {"instances": [{"prompt": "a", "max_new_tokens": "8"}]},
        error='instances[0].max_new_tokens must be an integer >= 1, not "8"',
    ),
    Case(
        "max_new_tokens a float",
        {"instances": [{"prompt": "a", "max_new_tokens": 8.0}]},
        error="instances[0].max_new_tokens",
    ),
    Case(
        "max_new_tokens a bool",
        {"instances": [{"prompt": "a", "max_new_tokens": True}]},
        error="instances[0].max_new_tokens",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parse_instances(case: Case) -> None:
    if case.error is not None:
        with pytest.raises(InvalidInput) as info:
            parse_instances(case.payload)
        assert case.error in str(info.value)
        return
    assert case.prompts is not None and case.max_new is not None
    assert parse_instances(case.payload) == [
        Instance(p, n) for p, n in zip(case.prompts, case.max_new, strict=True)
    ]


def test_parse_instances_takes_the_server_limit() -> None:
    payload = {"instances": [{"prompt": "a", "max_new_tokens": 20}]}
    assert parse_instances(payload, limit=20) == [Instance("a", 20)]
    with pytest.raises(InvalidInput, match=r"must be an integer 1\.\.10, not 20"):
        parse_instances(payload, limit=10)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> tuple[Any, Any]:
    return load_model(tiny_model_dir)


def test_same_length_prompts_batch_together(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    lengths = {len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in SAME_LENGTH}
    assert len(lengths) == 1, "the batch test below needs prompts of one token length"


def test_complete_is_deterministic_and_batch_independent(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    batched = complete(model, tokenizer, SAME_LENGTH)
    alone = [complete(model, tokenizer, [p])[0] for p in SAME_LENGTH]
    assert batched == alone
    assert complete(model, tokenizer, SAME_LENGTH) == batched
    # the random model must tell prompts apart, or a mix-up between them would go unseen
    assert len(set(batched)) > 1, batched


def test_complete_keeps_order_across_lengths(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    prompts = ["1+2=", "12+7=", "", "3+4=", "45+6="]
    out = complete(model, tokenizer, prompts, batch_size=1)
    assert out == [complete(model, tokenizer, [p])[0] for p in prompts]
    assert out[2] == ""  # an empty prompt has nothing to continue


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[CausalLMModel]:
    model = CausalLMModel("tiny", tiny_model_dir)
    assert model.ready is False
    assert model.load() is True
    assert model.ready is True
    yield model
    model.stop()
    assert model.ready is False


def test_causal_lm_model_predicts_what_complete_returns(
    served: CausalLMModel, loaded: tuple[Any, Any]
) -> None:
    budgets = [4, 1, 6, 4]
    payload = {
        "instances": [
            {"prompt": p, "max_new_tokens": n} for p, n in zip(SAME_LENGTH, budgets, strict=True)
        ]
    }
    answer = asyncio.run(served.predict(payload))
    model, tokenizer = loaded
    expected = [
        greedy_with_margins(model, tokenizer, [p], n)[0]
        for p, n in zip(SAME_LENGTH, budgets, strict=True)
    ]
    assert_same_greedy(answer["predictions"], expected, "predict")
    assert [a for a, _ in expected] == [
        complete(model, tokenizer, [p], n)[0] for p, n in zip(SAME_LENGTH, budgets, strict=True)
    ]


def test_greedy_with_margins_is_complete_with_gaps(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    prompts = ["1+2=", "12+7=", ""]
    out = greedy_with_margins(model, tokenizer, prompts, 5)
    assert [a for a, _ in out] == complete(model, tokenizer, prompts, 5)
    assert all(0 <= gap < float("inf") for _, gap in out[:2])
    assert out[2] == ("", float("inf"))  # nothing generated, nothing to compare


def test_a_prompt_beyond_the_context_names_the_numbers(served: CausalLMModel) -> None:
    payload = {"instances": [{"prompt": "1" * 60, "max_new_tokens": 10}]}
    with pytest.raises(InvalidInput, match=r"60 tokens .* 70 tokens, beyond .* 64 tokens"):
        asyncio.run(served.predict(payload))


def test_chat_needs_a_chat_template(tiny_model_dir: Path, served: CausalLMModel) -> None:
    request = ChatCompletionRequest(
        model="tiny", messages=[{"role": "user", "content": "1+2="}], max_completion_tokens=2
    )
    ok = asyncio.run(served.create_chat_completion(request))
    assert not isinstance(ok, AsyncIterator) and ok.choices[0].message.role == "assistant"
    template = served.tokenizer.chat_template
    served.tokenizer.chat_template = None
    try:
        with pytest.raises(RequestError) as info:
            asyncio.run(served.create_chat_completion(request))
    finally:
        served.tokenizer.chat_template = template
    assert info.value.field == "messages" and "has no chat template" in str(info.value)


def test_load_model_refuses_a_directory_without_config(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    (tmp_path / "model.safetensors").write_bytes(
        (tiny_model_dir / "model.safetensors").read_bytes()
    )
    with pytest.raises(
        FileNotFoundError, match=r"is not a model directory: config\.json is missing"
    ):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        CausalLMModel("tiny", tmp_path / "nowhere").load()


def test_max_tokens_limit_caps_what_a_request_asks_and_chats_default(
    served: CausalLMModel,
) -> None:
    from kubellm.serve.protocol import CompletionRequest

    chat = ChatCompletionRequest(
        model="tiny", messages=[{"role": "user", "content": "1+2="}], ignore_eos=True
    )
    served.max_tokens_limit = 5
    try:
        capped = asyncio.run(served.create_chat_completion(chat))
        with pytest.raises(RequestError, match=r"max_tokens is 6: more than .* limit of 5"):
            asyncio.run(
                served.create_completion(
                    CompletionRequest(model="tiny", prompt="1+2=", max_tokens=6)
                )
            )
        # min_tokens past the cap, with max_tokens unasked: refused too, not generated
        for request in (
            chat.model_copy(update={"min_tokens": 6}),
            CompletionRequest(model="tiny", prompt="1+2=", min_tokens=6),
        ):
            with pytest.raises(RequestError, match=r"min_tokens is 6: more than .* limit of 5"):
                asyncio.run(
                    served.create_chat_completion(request)
                    if isinstance(request, ChatCompletionRequest)
                    else served.create_completion(request)
                )
        at_cap = asyncio.run(
            served.create_chat_completion(chat.model_copy(update={"min_tokens": 5}))
        )
    finally:
        served.max_tokens_limit = None
    assert not isinstance(capped, AsyncIterator) and capped.usage is not None
    assert capped.usage.completion_tokens == 5
    assert not isinstance(at_cap, AsyncIterator) and at_cap.usage is not None
    assert at_cap.usage.completion_tokens == 5


def test_the_fast_path_tokenizes_as_the_transformers_tokenizer(served: CausalLMModel) -> None:
    """Prompts are encoded with the fast tokenizer's own `tokenizers.Tokenizer`, skipping the
    transformers wrapper's per-call work: it must give the wrapper's ids, special tokens
    spelled in the text included."""
    assert served._backend is not None, "the tiny model's tokenizer is a fast one"
    specials = [t for t in (served.tokenizer.eos_token, served.tokenizer.bos_token) if t]
    prompts = ["12+7=", " leading space", "tabs\tand\nnewlines", "ünïcødé 漢字 🙂", "a" * 500]
    prompts += [f"x{s}y" for s in specials]
    for prompt in prompts:
        want = served.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert served._encode(prompt, "prompt") == want, prompt


def test_long_prompts_are_tokenized_off_the_event_loop(
    served: CausalLMModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of more than INLINE_CHARS characters in all are tokenized on a worker
    thread, so the event loop goes on answering other requests meanwhile; short ones on the
    loop (a thread hand-off costs more than they do)."""
    import threading

    from kubellm.serve.model import INLINE_CHARS
    from kubellm.serve.protocol import CompletionRequest

    encode, seen = served._encode, []

    def recording(prompt: str, field: str) -> list[int]:
        seen.append((len(prompt), threading.get_ident()))
        return encode(prompt, field)

    monkeypatch.setattr(served, "_encode", recording)
    each = served.context_length * served.chars_per_token  # the longest prompt let through
    count = INLINE_CHARS // each + 1  # together over INLINE_CHARS, each within the bound

    async def ask(prompt: str | list[str]) -> int:
        with contextlib.suppress(RequestError):  # too many tokens for the context: fine
            await served.create_completion(
                CompletionRequest(model="tiny", prompt=prompt, max_tokens=1)
            )
        return threading.get_ident()

    loop_thread = asyncio.run(ask("1+2="))
    assert seen == [(4, loop_thread)]
    seen.clear()
    loop_thread = asyncio.run(ask(["1+2=" * (each // 4)] * count))
    assert len(seen) == count and sum(n for n, _ in seen) > INLINE_CHARS
    assert all(thread != loop_thread for _, thread in seen), seen
