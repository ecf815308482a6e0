"""stages.deploy: the loopback ModelServer serves the model and answers readiness."""

from __future__ import annotations

import requests

from kubellm.serve.client import Endpoint, is_ready
from stages.conftest import Chain


def test_endpoint_is_ready_on_loopback(chain: Chain) -> None:
    result = chain.results["deploy"]
    assert result.endpoint.startswith("http://127.0.0.1:")
    assert is_ready(Endpoint("tiny-stage", result.endpoint))
    body = {"instances": [{"prompt": "1+1=", "max_new_tokens": 2}]}
    r = requests.post(f"{result.endpoint}/v1/models/tiny-stage:predict", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1
    assert result.endpoint in result.headline
