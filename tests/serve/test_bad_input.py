"""Bad requests to the real server: each gets a 4xx whose message names the field, and the
server keeps serving (a good request right after succeeds)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from kubellm.serve.client import Endpoint

LONG = "1" * 60  # digits are one token each: 60 of the tiny model's 64 positions

ROUTES = {
    "completions": "/openai/v1/completions",
    "chat": "/openai/v1/chat/completions",
    "v1": "/v1/models/{model}:predict",
    "v2": "/v2/models/{model}/infer",
}
GOOD = {
    "completions": {"model": "tiny", "prompt": "1+2=", "max_tokens": 2, "temperature": 0},
    "chat": {"model": "tiny", "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2},
    "v1": {"instances": ["1+2="]},
    "v2": {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["1"]}]},
}


@dataclass(frozen=True)
class Case:
    name: str
    route: str  # a key of ROUTES
    body: dict[str, Any] | str  # a str is sent as is (malformed JSON)
    status: int
    says: tuple[str, ...]  # substrings of the error message (the field, the reason)
    model: str = "tiny"  # in the V1/V2 URL


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "1+2=", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def v2(data: list[Any], **fields: Any) -> dict[str, Any]:
    tensor = {"name": "text_input", "datatype": "BYTES", "shape": [len(data)], "data": data}
    return {"inputs": [{**tensor, **fields.pop("tensor", {})}], **fields}


CASES = [
    # OpenAI completions: 400, OpenAI's error shape, error.param the field
    Case("malformed json", "completions", '{"model": "tiny", "prompt": ', 400, ("not JSON",)),
    Case("not an object", "completions", "[1, 2]", 400, ("must be a JSON object",)),
    Case("no prompt", "completions", {"model": "tiny"}, 400, ("param=prompt",)),
    Case("empty prompt", "completions", completion(prompt=""), 400, ("prompt is empty",)),
    Case("empty prompt list", "completions", completion(prompt=[]), 400, ("prompt must hold",)),
    Case("empty prompt in list", "completions", completion(prompt=["a", ""]), 400, ("prompt[1]",)),
    Case("prompt a number", "completions", completion(prompt=7), 400, ("prompt must be a string",)),
    Case("prompt mixed", "completions", completion(prompt=[1, "a"]), 400, ("list of token ids",)),
    Case(
        "token id outside the vocabulary",
        "completions",
        completion(prompt=[1, 100_000]),
        400,
        ("prompt holds token id 100000", "outside the vocabulary", "param=prompt"),
    ),
    Case(
        "max_tokens zero",
        "completions",
        completion(max_tokens=0),
        400,
        ("max_tokens", "at least 1"),
    ),
    Case(
        "max_tokens over",
        "completions",
        completion(max_tokens=257),
        400,
        ("max_tokens is 257", "context length of 64"),
    ),
    Case(
        "max_tokens a string",
        "completions",
        completion(max_tokens="5"),
        400,
        ("max_tokens: Input should be a valid integer", '"5"', "param=max_tokens"),
    ),
    Case("max_tokens a float", "completions", completion(max_tokens=5.0), 400, ("max_tokens",)),
    Case("temperature a word", "completions", completion(temperature="hot"), 400, ("temperature",)),
    Case("temperature too hot", "completions", completion(temperature=3), 400, ("temperature",)),
    Case("top_p zero", "completions", completion(top_p=0), 400, ("top_p",)),
    Case("top_k below -1", "completions", completion(top_k=-2), 400, ("param=top_k",)),
    Case("min_tokens a bool", "completions", completion(min_tokens=True), 400, ("min_tokens",)),
    Case(
        "min_tokens over max_tokens",
        "completions",
        completion(min_tokens=3),
        400,
        ("min_tokens (3) is more than max_tokens (2)",),
    ),
    Case("stop a number", "completions", completion(stop=7), 400, ("stop must be",)),
    Case("stop empty", "completions", completion(stop=[""]), 400, ("stop",)),
    Case("seed a string", "completions", completion(seed="3"), 400, ("seed: Input should be",)),
    Case("stream a string", "completions", completion(stream="yes"), 400, ("stream",)),
    Case("logprobs over 20", "completions", completion(logprobs=21), 400, ("param=logprobs",)),
    Case(
        "logprobs streamed",
        "completions",
        completion(logprobs=1, stream=True),
        400,
        ("logprobs is not supported with stream", "param=logprobs"),
    ),
    # fields we do not implement: refused unless at their default, never silently ignored
    Case("n of 2", "completions", completion(n=2), 400, ("param=n", "n=2 is not supported")),
    Case("best_of", "completions", completion(best_of=3), 400, ("param=best_of",)),
    Case(
        "repetition_penalty",
        "completions",
        completion(repetition_penalty=1.1),
        400,
        ("repetition_penalty=1.1 is not supported", "param=repetition_penalty"),
    ),
    Case("presence_penalty", "completions", completion(presence_penalty=0.5), 400, ("presence",)),
    Case("frequency_penalty", "completions", completion(frequency_penalty=1), 400, ("frequency",)),
    Case("logit_bias", "completions", completion(logit_bias={"5": 10}), 400, ("logit_bias",)),
    Case("stop_token_ids", "completions", completion(stop_token_ids=[3]), 400, ("stop_token",)),
    Case("suffix", "completions", completion(suffix="x"), 400, ("param=suffix",)),
    Case(
        "response_format json",
        "completions",
        completion(response_format={"type": "json_object"}),
        400,
        ("param=response_format",),
    ),
    Case(
        "unknown field",
        "completions",
        completion(frobnicate=1),
        400,
        ("frobnicate is not a field of the completions API", "param=frobnicate"),
    ),
    Case(
        "prompt beyond the context",
        "completions",
        completion(prompt=LONG, max_tokens=8),
        400,
        ("prompt has 60 tokens", "max_tokens is 8", "68 tokens", "context length of 64"),
    ),
    Case(
        "prompt fills the context",
        "completions",
        {"model": "tiny", "prompt": LONG + "1111"},
        400,
        ("prompt has 64 tokens", "no room"),
    ),
    Case(
        "prompt too long to tokenize",
        "completions",
        completion(prompt="1" * 20_000),
        400,
        ("prompt is 20000 characters", "context length of 64", "param=prompt"),
    ),
    Case("unknown model", "completions", completion(model="nope"), 404, ("nope", "param=model")),
    # OpenAI chat
    Case("no messages", "chat", {"model": "tiny", "max_tokens": 2}, 400, ("param=messages",)),
    Case("empty messages", "chat", chat(messages=[]), 400, ("messages must be a non-empty",)),
    Case("message without content", "chat", chat(messages=[{"role": "user"}]), 400, ("content",)),
    Case("chat max_tokens a string", "chat", chat(max_tokens="5"), 400, ("max_tokens",)),
    Case("chat temperature a word", "chat", chat(temperature="hot"), 400, ("temperature",)),
    Case(
        "chat top_logprobs without logprobs",
        "chat",
        chat(top_logprobs=2),
        400,
        ("top_logprobs needs logprobs",),
    ),
    Case("chat logprobs an int", "chat", chat(logprobs=2), 400, ("param=logprobs",)),
    Case("chat tools", "chat", chat(tools=[{"type": "function"}]), 400, ("param=tools",)),
    Case("chat echo", "chat", chat(echo=True), 400, ("echo is not a field",)),
    Case(
        "chat beyond the context",
        "chat",
        chat(messages=[{"role": "user", "content": LONG}], max_tokens=2),
        400,
        ("messages has", "context length of 64"),
    ),
    Case("chat unknown model", "chat", chat(model="nope"), 404, ("nope",)),
    # V1 predict
    Case("v1 malformed json", "v1", '{"instances": [', 400, ("Unrecognized request format",)),
    Case("v1 empty prompt", "v1", {"instances": [""]}, 400, ("instances[0].prompt is empty",)),
    Case(
        "v1 max_new_tokens a string",
        "v1",
        {"instances": ["a", {"prompt": "b", "max_new_tokens": "5"}]},
        400,
        ("instances[1].max_new_tokens", '"5"'),
    ),
    Case(
        "v1 beyond the context",
        "v1",
        {"instances": [{"prompt": LONG, "max_new_tokens": 8}]},
        400,
        ("instances[0].prompt has 60 tokens", "context length of 64"),
    ),
    Case("v1 unknown model", "v1", {"instances": ["a"]}, 404, ("nope",), model="nope"),
    # V2 infer
    Case("v2 malformed json", "v2", '{"inputs": [', 422, ("JSON decode",)),
    Case("v2 no text_input", "v2", v2(["a"], tensor={"name": "text"}), 400, ("text_input",)),
    Case(
        "v2 not bytes",
        "v2",
        v2([1.0], tensor={"datatype": "FP32"}),
        400,
        ("text_input.datatype must be BYTES",),
    ),
    Case("v2 empty prompt", "v2", v2([""]), 400, ("text_input[0] is empty",)),
    Case("v2 shape", "v2", v2(["a"], tensor={"shape": [2]}), 400, ("text_input.shape",)),
    Case(
        "v2 temperature a word",
        "v2",
        v2(["a"], parameters={"temperature": "hot"}),
        400,
        ("parameters.temperature must be a number",),
    ),
    Case(
        "v2 max_tokens over",
        "v2",
        v2(["a"], parameters={"max_tokens": 1000}),
        400,
        ("text_input[0] has 1 tokens", "parameters.max_tokens is 1000", "context length of 64"),
    ),
    Case("v2 unknown model", "v2", v2(["a"]), 404, ("nope",), model="nope"),
]


def _message(r: requests.Response) -> str:
    """The error as a person reads it: kserve's {"error": "..."}, OpenAI's {"error":
    {"message", "param"}} or FastAPI's {"detail": [{"loc", "msg"}]}."""
    body = r.json()
    error = body.get("error")
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        return f"{error['message']} param={error.get('param')}"
    return json.dumps(body["detail"])


@pytest.fixture(scope="module")
def http() -> requests.Session:
    return requests.Session()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_is_a_4xx_naming_the_field(
    case: Case, server: Endpoint, http: requests.Session
) -> None:
    url = server.url + ROUTES[case.route].format(model=case.model)
    headers = {"content-type": "application/json"}
    if isinstance(case.body, str):
        r = http.post(url, data=case.body, headers=headers, timeout=30)
    else:
        r = http.post(url, json=case.body, timeout=30)
    assert r.status_code == case.status, r.text
    message = _message(r)
    for text in case.says:
        assert text in message, message
    good = http.post(server.url + ROUTES[case.route].format(model="tiny"), json=GOOD[case.route])
    assert good.status_code == 200, good.text
