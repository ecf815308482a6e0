"""The serving protocol, client side: the same routes locally and on a cluster.

The local server (`kubellm serve`) and KServe's Hugging Face runtime both answer
KServe's readiness route and the OpenAI-compatible completions route:

    GET  {url}/v1/models/{name}                      -> {"name": ..., "ready": true}
    POST {url}/openai/v1/completions  {"model": name, "prompt": "12+7=", "max_tokens": 8,
                                       "temperature": 0}
                                                     -> {"choices": [{"text": "19", ...}]}

so the smoke test and `kubellm promote` speak one protocol to either runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import requests


class ServingError(RuntimeError):
    """The endpoint answered, but not with what the protocol promises (or not in time)."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str  # base URL: the routes above hang off it

    @property
    def predict_url(self) -> str:
        return f"{self.url.rstrip('/')}/v1/models/{self.name}:predict"

    @property
    def ready_url(self) -> str:
        return f"{self.url.rstrip('/')}/v1/models/{self.name}"

    @property
    def openai_url(self) -> str:
        """The OpenAI client's base_url (`openai.OpenAI(base_url=...)`)."""
        return f"{self.url.rstrip('/')}/openai/v1"


def is_ready(endpoint: Endpoint) -> bool:
    try:
        r = requests.get(endpoint.ready_url, timeout=2)
        return r.status_code == 200 and bool(r.json().get("ready"))
    except (requests.RequestException, ValueError):
        return False


def complete(endpoint: Endpoint, prompt: str, max_tokens: int = 8, timeout_s: float = 60) -> str:
    """The greedy (temperature 0) completion of one prompt, stripped; ServingError naming the
    endpoint and what it answered otherwise (an HTTP error, a timeout, a malformed body)."""
    url = f"{endpoint.openai_url}/completions"
    body = {"model": endpoint.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    try:
        r = requests.post(url, json=body, timeout=timeout_s)
    except requests.Timeout:
        raise ServingError(f"{url} did not answer within {timeout_s:.0f}s") from None
    except requests.RequestException as err:
        raise ServingError(f"{url} unreachable: {err}") from None
    if r.status_code != 200:
        raise ServingError(f"{url} answered {r.status_code}: {r.text[:300]}")
    try:
        return str(r.json()["choices"][0]["text"]).strip()
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServingError(f"{url} returned {r.text[:300]}") from None


def ask(
    endpoint: Endpoint, prompts: list[str], max_new_tokens: int = 8, timeout_s: float = 60
) -> list[str]:
    """Greedy completions of `prompts`, in order, one request each (a request per prompt is
    what users send; batching several prompts in one request pads them together)."""
    return [complete(endpoint, p, max_new_tokens, timeout_s) for p in prompts]
