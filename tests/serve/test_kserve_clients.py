"""V1 predict, V2 (Open Inference Protocol) infer and readiness of the real server, through
kserve's own REST client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

from kubellm.serve.client import Endpoint
from kubellm.serve.generate import greedy_with_margins
from serve.compare import assert_same_greedy

PROMPTS = ["12+7=", "3+4=", "100+1="]
T = TypeVar("T")


def run(make: Any) -> Any:
    """Run `make(client_v1, client_v2)` (a coroutine) with fresh clients, closed after."""

    async def main() -> Any:
        v1 = InferenceRESTClient(RESTConfig(protocol="v1", retries=0))
        v2 = InferenceRESTClient(RESTConfig(protocol="v2", retries=0))
        try:
            return await make(v1, v2)
        finally:
            await v1.close()
            await v2.close()

    return asyncio.run(main())


async def _gather(*aws: Awaitable[T]) -> list[T]:
    return list(await asyncio.gather(*aws))


def test_readiness_and_liveness(server: Endpoint) -> None:
    async def check(v1: InferenceRESTClient, v2: InferenceRESTClient) -> list[Any]:
        return await _gather(
            v1.is_model_ready(server.url, "tiny"),
            v2.is_model_ready(server.url, "tiny"),
            v1.is_server_live(server.url),
            v2.is_server_live(server.url),
            v2.is_server_ready(server.url),
            v2.is_model_ready(server.url, "other"),
        )

    assert run(check) == [True, True, True, True, True, False]


def test_v1_predict_keeps_each_instance_max_new_tokens(
    server: Endpoint, in_process: tuple[Any, Any]
) -> None:
    budgets = [2, 6, 4]
    body = {
        "instances": [
            {"prompt": p, "max_new_tokens": n} for p, n in zip(PROMPTS, budgets, strict=True)
        ]
        + [PROMPTS[0]]  # a plain string takes the default of 8
    }

    async def predict(v1: InferenceRESTClient, _: InferenceRESTClient) -> Any:
        return await v1.infer(server.url, body, model_name="tiny")

    predictions = run(predict)["predictions"]
    model, tokenizer = in_process
    expected = [
        greedy_with_margins(model, tokenizer, [p], n)[0]
        for p, n in zip(PROMPTS, budgets, strict=True)
    ]
    expected += greedy_with_margins(model, tokenizer, PROMPTS[:1], 8)
    assert_same_greedy(predictions, expected, "v1 predictions")
    # the same prompt with 2 and 8 new tokens answers differently, so a budget taken from
    # another instance of the batch (today's bug) would have shown
    assert expected[0][0] != expected[3][0]


def _bytes_input(prompts: list[str], binary: bool) -> InferInput:
    tensor = InferInput("text_input", [len(prompts)], "BYTES")
    if binary:
        tensor.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=np.object_))
    else:
        tensor.data = prompts
    return tensor


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_v2_infer_bytes_tensor(server: Endpoint, in_process: tuple[Any, Any], binary: bool) -> None:
    request = InferRequest(
        model_name="tiny",
        infer_inputs=[_bytes_input(PROMPTS, binary)],
        request_id="req-1",
        parameters={"max_tokens": 5, "temperature": 0},
    )

    async def infer(_: InferenceRESTClient, v2: InferenceRESTClient) -> Any:
        return await v2.infer(server.url, request, model_name="tiny")

    response = run(infer)
    assert response.id == "req-1" and response.model_name == "tiny"
    (output,) = response.outputs
    assert (output.name, output.datatype, output.shape) == ("text_output", "BYTES", [3])
    answers = [a.decode() if isinstance(a, bytes) else a for a in output.data]
    assert_same_greedy(answers, greedy_with_margins(*in_process, PROMPTS, 5), "v2 outputs")


def test_v2_bad_parameter_is_a_400_naming_it(server: Endpoint) -> None:
    request = InferRequest(
        model_name="tiny",
        infer_inputs=[_bytes_input(PROMPTS[:1], False)],
        parameters={"max_tokens": "5"},
    )

    async def infer(_: InferenceRESTClient, v2: InferenceRESTClient) -> Any:
        return await v2.infer(server.url, request, model_name="tiny")

    with pytest.raises(httpx.HTTPStatusError) as info:
        run(infer)
    assert info.value.response.status_code == 400
    assert "parameters.max_tokens must be an integer" in info.value.response.json()["error"]


def test_v2_model_metadata_describes_the_tensors(server: Endpoint) -> None:
    meta = httpx.get(f"{server.url}/v2/models/tiny", timeout=10).json()
    assert meta["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]
