"""Locust load test of the model server: users send OpenAI completions until exactly N are done.

bench/serve_bench.py runs it as a process of its own: locust's gevent monkey-patching breaks
the kserve imports (RecursionError) in a process that has them. The installed
locust (2.46) has no `--iterations`, so this file counts: each request takes a ticket before it
is sent, a user that finds none left stops, and the runner quits once the Nth response is in
(so no request is cut short and none is left over). Its `--csv` files are only rewritten every
second, so a short run leaves them empty: `--bench-summary` writes locust's own totals instead.

    .venv/bin/locust -f bench/locustfile.py --headless -u 16 -r 16 --only-summary \
        --host http://127.0.0.1:8080 --bench-model kubellm --bench-requests 200 \
        --bench-summary /tmp/locust.json
"""

from __future__ import annotations

import json
import random
from typing import Any

import gevent
from locust import FastHttpUser, constant, events, task
from locust.env import Environment
from locust.exception import StopUser

ROUTE = "/openai/v1/completions"
# tickets issued, responses counted, the prompts, the environment (set at init)
_state: dict[str, Any] = {"issued": 0, "done": 0, "prompts": [], "env": None, "quitting": False}


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--bench-requests", type=int, default=200, help="requests, then quit")
    parser.add_argument("--bench-model", default="kubellm", help="the served model's name")
    parser.add_argument("--bench-max-tokens", type=int, default=8, help="max_tokens per request")
    parser.add_argument(
        "--bench-prompts", default="", help="JSON list of prompts (default: 64 'a+b=' prompts)"
    )
    parser.add_argument(
        "--bench-summary", default="", help="write locust's own totals here as JSON at the end"
    )


@events.init.add_listener
def _keep_environment(environment: Environment, **_: Any) -> None:
    _state["env"] = environment


@events.test_start.add_listener
def _load_prompts(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is not None and opts.bench_prompts:
        with open(opts.bench_prompts) as f:
            _state["prompts"] = list(json.load(f))
    else:  # the shape of kubellm.data.synthetic's prompts, without importing kubellm here
        rng = random.Random(1)
        _state["prompts"] = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(64)]


@events.request.add_listener
def _count(**_: Any) -> None:
    """Quit once the last ticket's response is in, from a greenlet of its own (quitting stops
    the users, the one that fired this event among them)."""
    _state["done"] += 1
    env = _state["env"]
    if env is None or env.runner is None or env.parsed_options is None or _state["quitting"]:
        return
    if _state["done"] >= env.parsed_options.bench_requests:
        _state["quitting"] = True
        gevent.spawn(env.runner.quit)


@events.quitting.add_listener
def _write_summary(environment: Environment, **_: Any) -> None:
    """Locust's figures for the route and in total: counts, its percentiles (of response
    times rounded as locust stores them) and requests/s from first to last request."""
    opts = environment.parsed_options
    if opts is None or not opts.bench_summary:
        return
    stats = environment.stats

    def entry(e: Any) -> dict[str, Any]:
        def pct(q: float) -> float | None:
            return e.get_response_time_percentile(q) if e.num_requests else None

        return {
            "requests": e.num_requests,
            "failures": e.num_failures,
            "p50_ms": pct(0.50),
            "p95_ms": pct(0.95),
            "p99_ms": pct(0.99),
            "avg_ms": e.avg_response_time,
            "max_ms": e.max_response_time,
            "rps": e.total_rps,
        }

    summary = {
        "total": entry(stats.total),
        "route": entry(stats.get(ROUTE, "POST")),
        "errors": [
            {"name": e.name, "error": str(e.error), "occurrences": e.occurrences}
            for e in stats.errors.values()
        ],
        "issued": _state["issued"],
        "users": opts.num_users,
    }
    with open(opts.bench_summary, "w") as f:
        json.dump(summary, f, indent=2)


class CompletionUser(FastHttpUser):  # type: ignore[misc]
    """One client: a keep-alive connection, requests back to back (no think time)."""

    wait_time = constant(0)

    @task
    def complete(self) -> None:
        opts = self.environment.parsed_options
        if _state["issued"] >= opts.bench_requests:
            raise StopUser()
        index = _state["issued"]
        _state["issued"] += 1
        prompts = _state["prompts"]
        body = {
            "model": opts.bench_model,
            "prompt": prompts[index % len(prompts)],
            "max_tokens": opts.bench_max_tokens,
            "temperature": 0,
        }
        with self.client.post(ROUTE, json=body, catch_response=True, name=ROUTE) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                return
            try:
                choices = resp.json()["choices"]
                ok = len(choices) == 1 and isinstance(choices[0]["text"], str)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                resp.failure(f"not a completion: {(resp.text or '')[:200]}")
