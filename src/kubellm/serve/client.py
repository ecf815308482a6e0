"""The serving protocol, client side: KServe V1 predict, the same locally and on a cluster.

POST {url}/v1/models/{name}:predict  {"instances": [{"prompt": "...", "max_new_tokens": 8}]}
-> {"predictions": ["completion text", ...]}
"""

from __future__ import annotations

from dataclasses import dataclass

import requests


class ServingError(RuntimeError):
    """The endpoint answered, but not with what the protocol promises."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str  # base URL; predict is {url}/v1/models/{name}:predict

    @property
    def predict_url(self) -> str:
        return f"{self.url.rstrip('/')}/v1/models/{self.name}:predict"

    @property
    def ready_url(self) -> str:
        return f"{self.url.rstrip('/')}/v1/models/{self.name}"


def is_ready(endpoint: Endpoint) -> bool:
    try:
        r = requests.get(endpoint.ready_url, timeout=2)
        return r.status_code == 200 and bool(r.json().get("ready"))
    except (requests.RequestException, ValueError):
        return False


def ask(endpoint: Endpoint, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
    """Completions of `prompts`, in order; ServingError naming the endpoint otherwise."""
    body = {"instances": [{"prompt": p, "max_new_tokens": max_new_tokens} for p in prompts]}
    r = requests.post(endpoint.predict_url, json=body, timeout=120)
    if r.status_code != 200:
        raise ServingError(f"{endpoint.predict_url} answered {r.status_code}: {r.text[:300]}")
    predictions = r.json().get("predictions")
    if not isinstance(predictions, list) or len(predictions) != len(prompts):
        raise ServingError(f"{endpoint.predict_url} returned {r.text[:300]}")
    return [str(p) for p in predictions]
