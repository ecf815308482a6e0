"""The serving protocol, client side: the same routes locally and on a cluster.

The local server (`kubellm serve`) and KServe's Hugging Face runtime both answer
KServe's readiness route and the OpenAI-compatible completions route:

    GET  {url}/v1/models/{name}                      -> {"name": ..., "ready": true}
    POST {url}/openai/v1/completions  {"model": name, "prompt": "12+7=", "max_tokens": 8,
                                       "temperature": 0}
                                                     -> {"choices": [{"text": "19", ...}]}
    POST {url}/openai/v1/chat/completions  {"model": name, "messages": [...], ...}
                                                     -> {"choices": [{"message": {"content": ..}}]}

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
    body = {"model": endpoint.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return _post(f"{endpoint.openai_url}/completions", body, timeout_s, ("text",))


def chat(
    endpoint: Endpoint, messages: list[dict[str, str]], max_tokens: int = 8, timeout_s: float = 60
) -> str:
    """The greedy answer of the chat completions route to `messages` (the server renders
    them with the model's chat template), stripped; ServingError as `complete`."""
    body = {
        "model": endpoint.name,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return _post(f"{endpoint.openai_url}/chat/completions", body, timeout_s, ("message", "content"))


def _post(url: str, body: dict[str, object], timeout_s: float, path: tuple[str, ...]) -> str:
    """POST an OpenAI request; the first choice's text at `path`, stripped."""
    try:
        r = requests.post(url, json=body, timeout=timeout_s)
    except requests.Timeout:
        raise ServingError(f"{url} did not answer within {timeout_s:.0f}s") from None
    except requests.RequestException as err:
        raise ServingError(f"{url} unreachable: {err}") from None
    if r.status_code != 200:
        raise ServingError(f"{url} answered {r.status_code}: {r.text[:300]}")
    try:
        answer = r.json()["choices"][0]
        for key in path:
            answer = answer[key]
        return str(answer).strip()
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServingError(f"{url} returned {r.text[:300]}") from None


def ask(
    endpoint: Endpoint, prompts: list[str], max_new_tokens: int = 8, timeout_s: float = 60
) -> list[str]:
    """Greedy completions of `prompts`, in order, one request each (a request per prompt is
    what users send; batching several prompts in one request pads them together)."""
    return [complete(endpoint, p, max_new_tokens, timeout_s) for p in prompts]
