"""The batching engine: concurrent requests of different lengths and budgets decoded together
give what each gets alone (token for token, near-ties excused and reported), each keeping its
own max_tokens and stop strings; and the same over HTTP with concurrent clients."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from kubellm.serve.client import Endpoint
from kubellm.serve.engine import BatchEngine, EngineOptions, SamplingParams
from kubellm.serve.generate import greedy_with_margins
from serve.compare import assert_same_greedy


def mixed_prompts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens): sums of 1- to 7-digit numbers (2 to 13 tokens), 1 to 24 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 10 ** rng.randint(1, 6)), rng.randint(0, 10 ** rng.randint(0, 4))
        out.append((f"{a}+{b}=", rng.randint(1, 24)))
    return out


@pytest.fixture(scope="module")
def engine(in_process: tuple[Any, Any]) -> Iterator[BatchEngine]:
    e = BatchEngine(*in_process, EngineOptions(max_batch=16, max_wait_ms=50))
    e.start()
    yield e
    e.stop()


def encode(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_batched_greedy_equals_one_at_a_time(
    engine: BatchEngine, in_process: tuple[Any, Any]
) -> None:
    model, tokenizer = in_process
    cases = mixed_prompts(20)
    lengths = {len(encode(tokenizer, p)) for p, _ in cases}
    assert len(lengths) > 3, "the batch must mix prompt lengths (padding)"
    work = [(encode(tokenizer, p), SamplingParams(max_tokens=n)) for p, n in cases]
    before = engine.batches_run
    batched = engine.generate_sync(work)
    assert engine.batches_run - before <= 2 and engine.largest_batch == 16  # 20 = 16 + 4
    alone = [engine.generate_sync([w])[0] for w in work]
    for b, (ids, params) in zip(batched, work, strict=True):
        n = params.max_tokens
        assert len(b.token_ids) <= n and b.prompt_tokens == len(ids)
        assert b.finish_reason == ("length" if len(b.token_ids) == n else "stop")
    # token for token with the lone runs, excusing near-ties
    assert_same_greedy(
        [" ".join(map(str, b.token_ids)) for b in batched],
        [(" ".join(map(str, a.token_ids)), a.min_margin) for a in alone],
        "batched vs alone",
    )
    # and a lone run is what model.generate (evaluate's `complete`) answers
    reference = [greedy_with_margins(model, tokenizer, [p], n)[0] for p, n in cases]
    assert_same_greedy([a.text.strip() for a in alone], reference, "alone vs generate")


def test_stop_and_max_tokens_hold_inside_a_mixed_batch(
    engine: BatchEngine, in_process: tuple[Any, Any]
) -> None:
    _, tokenizer = in_process
    prompts = [encode(tokenizer, p) for p in ("12+7=", "3+4=", "100+1=", "45+6=")]
    (long,) = engine.generate_sync([(prompts[0], SamplingParams(max_tokens=20))])
    assert long.finish_reason == "length"
    stop = next(c for c in long.text[2:] if c.isprintable() and c not in "\ufffd ")
    work = [
        (prompts[0], SamplingParams(max_tokens=20, stop=("never-there", stop))),
        (prompts[1], SamplingParams(max_tokens=2)),
        (prompts[2], SamplingParams(max_tokens=20)),
        (prompts[3], SamplingParams(max_tokens=5)),
    ]
    results = engine.generate_sync(work)
    assert results[0].text == long.text[: long.text.index(stop)]
    assert results[0].finish_reason == "stop"
    assert len(results[0].token_ids) < 20
    for r, (_, p) in zip(results[1:], work[1:], strict=True):
        assert len(r.token_ids) <= p.max_tokens
        assert (r.finish_reason == "length") == (len(r.token_ids) == p.max_tokens)
    # the others are unaffected by the row that stopped early
    for r, (ids, p) in zip(results[1:], work[1:], strict=True):
        (alone,) = engine.generate_sync([(ids, p)])
        assert_same_greedy([r.text], [(alone.text, alone.min_margin)], "mixed batch")


def test_sampling_is_per_request(engine: BatchEngine, in_process: tuple[Any, Any]) -> None:
    """A seeded sample does not depend on what shares its batch; greedy rows stay greedy."""
    _, tokenizer = in_process
    ids = encode(tokenizer, "3+4=")
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=11)
    (alone,) = engine.generate_sync([(ids, seeded)])
    others = [(encode(tokenizer, p), SamplingParams(max_tokens=8)) for p, _ in mixed_prompts(5)]
    together = engine.generate_sync([*others, (ids, seeded), (ids, seeded)])
    assert together[-1].token_ids == together[-2].token_ids == alone.token_ids


def test_concurrent_http_requests_match_in_process_greedy(
    server: Endpoint, in_process: tuple[Any, Any]
) -> None:
    cases = mixed_prompts(24, seed=1)
    session = requests.Session()

    def ask(case: tuple[str, int]) -> dict[str, Any]:
        prompt, n = case
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0}
        r = session.post(f"{server.openai_url}/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return dict(r.json())

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(ask, cases))
    for answer, (_, n) in zip(answers, cases, strict=True):
        assert answer["usage"]["completion_tokens"] <= n
    reference = [greedy_with_margins(*in_process, [p], n)[0] for p, n in cases]
    assert_same_greedy(
        [a["choices"][0]["text"].strip() for a in answers], reference, "concurrent http"
    )
