"""The model behind the server, in-process: payload parsing, greedy completion, loading."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kserve.errors import InvalidInput

from kubellm.serve.generate import complete, load_model
from kubellm.serve.model import MAX_INSTANCES, MAX_NEW_TOKENS, CausalLMModel, parse_instances

# Same token length (digits are one token each), so `complete` puts them in one batch.
SAME_LENGTH = ["12+7=", "45+6=", "99+1=", "30+5="]


@dataclass(frozen=True)
class Case:
    name: str
    payload: Any
    prompts: list[str] | None = None  # expected prompts on success
    max_new: int | None = None  # expected max_new_tokens on success
    error: str | None = None  # substring of the InvalidInput message on failure


CASES = [
    Case("strings", {"instances": ["1+2=", "3+4="]}, ["1+2=", "3+4="], 8),
    Case("dict default", {"instances": [{"prompt": "1+2="}]}, ["1+2="], 8),
    Case("dict with max", {"instances": [{"prompt": "a", "max_new_tokens": 3}]}, ["a"], 3),
    Case("lower bound", {"instances": [{"prompt": "a", "max_new_tokens": 1}]}, ["a"], 1),
    Case(
        "upper bound",
        {"instances": [{"prompt": "a", "max_new_tokens": MAX_NEW_TOKENS}]},
        ["a"],
        MAX_NEW_TOKENS,
    ),
    Case(
        "largest max wins",
        {"instances": [{"prompt": "a", "max_new_tokens": 3}, {"prompt": "b", "max_new_tokens": 5}]},
        ["a", "b"],
        5,
    ),
    Case(
        "largest max wins, reversed",
        {"instances": [{"prompt": "a", "max_new_tokens": 5}, {"prompt": "b", "max_new_tokens": 3}]},
        ["a", "b"],
        5,
    ),
    Case("empty prompt is a prompt", {"instances": [""]}, [""], 8),
    Case("max instances", {"instances": ["x"] * MAX_INSTANCES}, ["x"] * MAX_INSTANCES, 8),
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
        error=f"instances[0].max_new_tokens must be 1..{MAX_NEW_TOKENS}",
    ),
    Case(
        "max_new_tokens too big",
        {"instances": ["a", {"prompt": "b", "max_new_tokens": MAX_NEW_TOKENS + 1}]},
        error=f"instances[1].max_new_tokens must be 1..{MAX_NEW_TOKENS}",
    ),
    Case(
        "max_new_tokens a string",
        {"instances": [{"prompt": "a", "max_new_tokens": "8"}]},
        error="instances[0].max_new_tokens",
    ),
    Case(
        "max_new_tokens a float",
        {"instances": [{"prompt": "a", "max_new_tokens": 8.0}]},
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
    assert parse_instances(case.payload) == (case.prompts, case.max_new)


ORDER_CASES = [
    Case("string then dict", {"instances": ["a", {"prompt": "b", "max_new_tokens": 3}]}),
    Case("dict then string", {"instances": [{"prompt": "b", "max_new_tokens": 3}, "a"]}),
    Case(
        "default then dict", {"instances": [{"prompt": "a"}, {"prompt": "b", "max_new_tokens": 3}]}
    ),
    Case(
        "dict then default", {"instances": [{"prompt": "b", "max_new_tokens": 3}, {"prompt": "a"}]}
    ),
]


def test_parse_instances_max_new_tokens_does_not_depend_on_order() -> None:
    # An instance without max_new_tokens asks for the default (8); the batch takes the largest.
    assert [parse_instances(c.payload)[1] for c in ORDER_CASES] == [8, 8, 8, 8]


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


def test_causal_lm_model_predicts_what_complete_returns(
    tiny_model_dir: Path, loaded: tuple[Any, Any]
) -> None:
    served = CausalLMModel("tiny", tiny_model_dir)
    assert served.ready is False
    assert served.load() is True
    assert served.ready is True
    payload = {"instances": [{"prompt": p, "max_new_tokens": 4} for p in SAME_LENGTH]}
    answer = asyncio.run(served.predict(payload))
    model, tokenizer = loaded
    assert answer == {"predictions": complete(model, tokenizer, SAME_LENGTH, max_new_tokens=4)}


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
