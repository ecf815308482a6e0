"""Prometheus metrics of the batching engine, on prometheus_client's default REGISTRY, which
kserve's `/metrics` route exposes next to its own.

Named after vLLM's, which load generators, autoscalers (KEDA, KServe's own) and the
community Grafana dashboards already query, with `kubellm_` for `vllm:` (a colon is meant
for recording rules, not instrumented metrics):

| kubellm                                   | vLLM                                   |
|-------------------------------------------|----------------------------------------|
| kubellm_prompt_tokens_total               | vllm:prompt_tokens_total               |
| kubellm_generation_tokens_total           | vllm:generation_tokens_total           |
| kubellm_time_to_first_token_seconds       | vllm:time_to_first_token_seconds       |
| kubellm_e2e_request_latency_seconds       | vllm:e2e_request_latency_seconds       |
| kubellm_request_success_total             | vllm:request_success_total             |
| kubellm_num_requests_waiting              | vllm:num_requests_waiting              |
| kubellm_num_requests_running              | vllm:num_requests_running              |

Every series carries `model_name` (the served name), as vLLM's do. The request counter's
`finished_reason` is the OpenAI finish reason ("stop", "length") or the engine's own
("timeout", "cancelled"), and "error" for a request that failed; unlike vLLM's it counts
every ending, so rate(kubellm_request_success_total[5m]) is the request rate.

Generation tokens are those a caller is billed for (`usage.completion_tokens`): an EOS that
ends a request is not one (the engine does not return it), one that `ignore_eos` keeps is.

The module is imported once per process, so each metric is created once; `_metric` still
returns the registered collector when a name is already taken (a module reloaded by a test
runner), rather than failing with "Duplicated timeseries".
"""

from __future__ import annotations

from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)

LABELS = ("model_name",)

# vLLM's buckets: TTFT from 1 ms (a short prompt on a GPU) to minutes (a queued long prompt)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def _metric(cls: type[M], name: str, doc: str, labels: tuple[str, ...], **kw: Any) -> M:
    existing = REGISTRY._names_to_collectors.get(name)  # no public lookup by name
    if existing is not None:
        if not isinstance(existing, cls):
            raise RuntimeError(f"metric {name} is registered already as another type")
        return existing
    return cls(name, doc, labels, **kw)


PROMPT_TOKENS = _metric(
    Counter, "kubellm_prompt_tokens", "Prompt tokens prefilled.", LABELS
)  # exposed as kubellm_prompt_tokens_total
GENERATION_TOKENS = _metric(
    Counter, "kubellm_generation_tokens", "Tokens generated (returned to callers).", LABELS
)
TIME_TO_FIRST_TOKEN = _metric(
    Histogram,
    "kubellm_time_to_first_token_seconds",
    "Seconds from a request's arrival at the engine to its first generated token.",
    LABELS,
    buckets=TTFT_BUCKETS,
)
E2E_LATENCY = _metric(
    Histogram,
    "kubellm_e2e_request_latency_seconds",
    "Seconds from a request's arrival at the engine to its end.",
    LABELS,
    buckets=LATENCY_BUCKETS,
)
REQUESTS_FINISHED = _metric(
    Counter,
    "kubellm_request_success",
    "Requests ended, by finish reason (stop, length, timeout, cancelled, error).",
    (*LABELS, "finished_reason"),
)
REQUESTS_WAITING = _metric(
    Gauge, "kubellm_num_requests_waiting", "Requests queued for the next batch.", LABELS
)
REQUESTS_RUNNING = _metric(
    Gauge, "kubellm_num_requests_running", "Requests in the batch being decoded.", LABELS
)


class EngineMetrics:
    """One engine's children of the metrics above (label lookups done once, not per step)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.prompt_tokens = PROMPT_TOKENS.labels(model_name)
        self.generation_tokens = GENERATION_TOKENS.labels(model_name)
        self.time_to_first_token = TIME_TO_FIRST_TOKEN.labels(model_name)
        self.e2e_latency = E2E_LATENCY.labels(model_name)
        self.waiting = REQUESTS_WAITING.labels(model_name)
        self.running = REQUESTS_RUNNING.labels(model_name)
        self._finished: dict[str, Any] = {}

    def finished(self, reason: str) -> None:
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = REQUESTS_FINISHED.labels(self.model_name, reason)
        child.inc()
