"""The batching engine's generation features, in process on the tiny model: prompt and
token logprobs against log_softmax of the model's own logits (unpadded, one prompt per
forward), top_k, min_tokens, ignore_eos, prefill-only scoring (max_tokens=0) and the
Prometheus metrics the engine keeps."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from kubellm.serve.engine import (
    BatchEngine,
    EngineOptions,
    Event,
    Generation,
    GenerationRequest,
    SamplingParams,
)
from serve.compare import NEAR_TIE, assert_same_greedy

TOL = 1e-4
PROMPTS = ("3+4=", "12+7=", "100+1=", "45+6=", "123456+789=", "7=")
_names = itertools.count()


def encode(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def new_engine(in_process: tuple[Any, Any], eos: set[int] | None = None) -> BatchEngine:
    """An engine with its own metric labels; `eos` replaces the EOS ids it stops on."""
    e = BatchEngine(*in_process, EngineOptions(max_batch=16), model_name=f"t{next(_names)}")
    if eos is not None:
        e.eos_ids = eos
    e.start()
    return e


@pytest.fixture(scope="module")
def engine(in_process: tuple[Any, Any]) -> Iterator[BatchEngine]:
    e = new_engine(in_process)
    yield e
    e.stop()


@torch.inference_mode()
def log_softmax_of(model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: log_softmax of the model's logits on `ids` alone, unpadded."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def greedy_first_token(model: Any, ids: list[int]) -> int:
    return int(log_softmax_of(model, ids)[-1].argmax())


def assert_top(got: list[tuple[int, float]], expected_row: torch.Tensor, k: int) -> None:
    values, ids = expected_row.topk(k)
    assert [v for _, v in got] == pytest.approx(values.tolist(), abs=TOL)
    for (got_id, _), want_id, value in zip(got, ids.tolist(), values.tolist(), strict=True):
        # an id may swap with a tied neighbour only
        assert got_id == want_id or abs(float(expected_row[got_id]) - value) < TOL


def test_prompt_logprobs_equal_unpadded_log_softmax_in_a_mixed_batch(
    engine: BatchEngine, in_process: tuple[Any, Any]
) -> None:
    model, tokenizer = in_process
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) >= 4, "the batch must mix lengths (left padding)"
    work = [
        (ids, SamplingParams(max_tokens=i % 3, prompt_logprobs=2 if i % 2 else 0))
        for i, ids in enumerate(prompts)
    ]
    decoding = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    work.append((prompts[4], decoding))
    work.append((prompts[0], SamplingParams(max_tokens=3)))  # a row that asks for none
    before = engine.batches_run
    results = engine.generate_sync(work)
    assert engine.batches_run - before == 1, "all rows must share one prefill"
    for (ids, params), r in zip(work[:-1], results, strict=False):
        ref = log_softmax_of(model, ids)
        assert r.prompt_token_ids == ids and r.prompt_logprobs is not None
        assert r.prompt_top_logprobs is not None
        assert len(r.prompt_logprobs) == len(ids) and r.prompt_logprobs[0] is None
        assert r.prompt_top_logprobs[0] is None
        expected = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
        assert r.prompt_logprobs[1:] == pytest.approx(expected, abs=TOL)
        k = params.prompt_logprobs or 0
        for j in range(1, len(ids)):
            top = r.prompt_top_logprobs[j]
            assert top is not None and len(top) == k
            assert_top(top, ref[j - 1], k)
        if params.max_tokens == 0:  # prefill only
            assert (r.token_ids, r.text, r.finish_reason) == ([], "", "length")
            assert r.first_token_s is None
        else:
            assert 1 <= len(r.token_ids) <= params.max_tokens and r.first_token_s is not None
    plain = results[-1]
    assert plain.prompt_logprobs is None and plain.prompt_token_ids is None
    assert plain.logprobs is None and plain.top_logprobs is None
    # keeping every position's logits does not change what a row generates
    (alone,) = engine.generate_sync([(prompts[4], SamplingParams(max_tokens=6, ignore_eos=True))])
    assert_same_greedy([str(results[-2].token_ids)], [(str(alone.token_ids), alone.min_margin)], "")


def test_max_tokens_zero_needs_prompt_logprobs() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(max_tokens=2, top_k=-1)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_token_logprobs_equal_each_steps_log_softmax(
    engine: BatchEngine, in_process: tuple[Any, Any]
) -> None:
    """Greedy and sampled rows, batched with others: each token's logprob is the raw
    log_softmax of its step (not temperature-scaled), the top ones are that step's best."""
    model, tokenizer = in_process
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True)
    sampled = SamplingParams(
        max_tokens=8, temperature=1.5, top_k=5, seed=3, logprobs=0, ignore_eos=True
    )
    work = [(prompts[1], greedy), (prompts[4], sampled)]
    work += [(ids, SamplingParams(max_tokens=5)) for ids in prompts]
    results = engine.generate_sync(work)
    for (ids, params), r in zip(work[:2], results, strict=False):
        assert len(r.token_ids) == 8 and r.logprobs is not None and r.top_logprobs is not None
        assert len(r.logprobs) == len(r.top_logprobs) == 8
        for step, token in enumerate(r.token_ids):
            ref = log_softmax_of(model, ids + r.token_ids[:step])[-1]
            assert r.logprobs[step] == pytest.approx(float(ref[token]), abs=TOL)
            if params.temperature == 0:
                assert_top(r.top_logprobs[step], ref, 3)
                best, second = ref.topk(2).values.tolist()
                assert token == int(ref.argmax()) or best - second < NEAR_TIE
            else:
                assert r.top_logprobs[step] == []  # logprobs=0: the chosen token's only
                assert token in ref.topk(5).indices.tolist()  # top_k=5
    assert all(r.logprobs is None for r in results[2:])


def test_top_k_one_is_greedy_and_top_k_bounds_the_sample(
    engine: BatchEngine, in_process: tuple[Any, Any]
) -> None:
    _, tokenizer = in_process
    prompts = [encode(tokenizer, p) for p in PROMPTS[:3]]
    n = 16

    def run(**kw: Any) -> list[Generation]:
        return engine.generate_sync(
            [(ids, SamplingParams(max_tokens=n, ignore_eos=True, **kw)) for ids in prompts]
        )

    greedy = [r.token_ids for r in run()]
    hot = dict(temperature=1.0, seed=5)
    assert [r.token_ids for r in run(top_k=1, **hot)] == greedy
    # the check can fail: sampling at this temperature leaves the greedy path
    assert [r.token_ids for r in run(**hot)] != greedy
    wide = dict(temperature=3.0, seed=7, logprobs=3)
    for r in run(top_k=3, **wide):
        assert r.top_logprobs is not None
        for t, top in zip(r.token_ids, r.top_logprobs, strict=True):
            assert t in [i for i, _ in top]
    outside = [
        t not in [i for i, _ in top]
        for r in run(**wide)
        for t, top in zip(r.token_ids, r.top_logprobs or [], strict=True)
    ]
    assert any(outside), "without top_k the sample must leave the top 3 sometimes"


def test_min_tokens_keeps_eos_away(in_process: tuple[Any, Any]) -> None:
    """EOS made the greedy first token: the request ends at once, unless min_tokens."""
    model, tokenizer = in_process
    ids = encode(tokenizer, "12+7=")
    eos = greedy_first_token(model, ids)
    engine = new_engine(in_process, eos={eos})
    try:
        (plain,) = engine.generate_sync([(ids, SamplingParams(max_tokens=8))])
        assert (plain.token_ids, plain.finish_reason) == ([], "stop")
        params = SamplingParams(max_tokens=8, min_tokens=4, logprobs=2)
        (r,) = engine.generate_sync([(ids, params)])
        assert len(r.token_ids) >= 4 and eos not in r.token_ids[:4]
        assert r.top_logprobs is not None and r.logprobs is not None
        # raw logprobs: the masked EOS is still the most likely token of step one, and
        # the runner-up is what was picked
        (first, _), (second, second_lp) = r.top_logprobs[0]
        assert first == eos and r.token_ids[0] == second
        assert r.logprobs[0] == pytest.approx(second_lp, abs=TOL)
        if r.finish_reason == "stop":  # EOS again, once allowed
            assert len(r.token_ids) < 8
    finally:
        engine.stop()


def test_stop_strings_wait_for_min_tokens(engine: BatchEngine, in_process: tuple[Any, Any]) -> None:
    _, tokenizer = in_process
    ids = encode(tokenizer, "45+6=")
    (free,) = engine.generate_sync([(ids, SamplingParams(max_tokens=10, ignore_eos=True))])
    stop = next(c for c in free.text if c.strip() and c != "\ufffd")
    cut = free.text.index(stop)
    early_params = SamplingParams(max_tokens=10, stop=(stop,), ignore_eos=True)
    (early,) = engine.generate_sync([(ids, early_params)])
    assert early.text == free.text[:cut] and early.finish_reason == "stop"
    params = SamplingParams(max_tokens=10, stop=(stop,), min_tokens=6, ignore_eos=True)
    (late,) = engine.generate_sync([(ids, params)])
    assert len(late.token_ids) >= 6 and late.token_ids == free.token_ids[: len(late.token_ids)]
    # a stop string counts only where it ends in text after the sixth token's start
    before = len(tokenizer.decode(free.token_ids[:5], skip_special_tokens=True))
    hit = free.text.find(stop, max(0, before - len(stop) + 1))
    assert late.text == (free.text if hit < 0 else free.text[:hit])


def test_ignore_eos_runs_to_max_tokens(in_process: tuple[Any, Any]) -> None:
    model, tokenizer = in_process
    ids = encode(tokenizer, "3+4=")
    eos = greedy_first_token(model, ids)
    engine = new_engine(in_process, eos={eos})
    try:
        params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
        (r,) = engine.generate_sync([(ids, params)])
        assert r.finish_reason == "length" and len(r.token_ids) == 6
        assert r.token_ids[0] == eos  # kept as a token, as vLLM does
        assert r.logprobs is not None and len(r.logprobs) == 6
    finally:
        engine.stop()


def sample(name: str, model_name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model_name": model_name, **labels}) or 0.0


def test_metrics_count_tokens_requests_and_batch(in_process: tuple[Any, Any]) -> None:
    _, tokenizer = in_process
    engine = new_engine(in_process)
    name = engine.metrics.model_name
    try:
        prompts = [encode(tokenizer, p) for p in PROMPTS[:3]]
        budgets = [2, 7, 7]
        seen_running: list[float] = []
        finished: list[Generation] = []
        done = threading.Event()

        def emit(event: Event) -> None:
            seen_running.append(sample("kubellm_num_requests_running", name))
            if isinstance(event, Generation):
                finished.append(event)
                if len(finished) == len(prompts):
                    done.set()

        engine.submit(
            [
                GenerationRequest(ids, SamplingParams(max_tokens=n), emit, stream=True)
                for ids, n in zip(prompts, budgets, strict=True)
            ]
        )
        assert done.wait(60)
        scored = engine.generate_sync([(prompts[0], SamplingParams(0, prompt_logprobs=0))])
        generated = sum(len(g.token_ids) for g in finished)
        assert generated > 0
        assert sample("kubellm_prompt_tokens_total", name) == 2 * len(prompts[0]) + sum(
            len(p) for p in prompts[1:]
        )
        assert sample("kubellm_generation_tokens_total", name) == generated
        reasons = [g.finish_reason for g in [*finished, *scored]]
        for reason in ("stop", "length"):
            got = sample("kubellm_request_success_total", name, finished_reason=reason)
            assert got == reasons.count(reason)
        assert sample("kubellm_time_to_first_token_seconds_count", name) == len(prompts)
        assert sample("kubellm_e2e_request_latency_seconds_count", name) == len(prompts) + 1
        assert max(seen_running) == len(prompts)  # the batch, while it decoded
        assert sample("kubellm_num_requests_running", name) == 0
        assert sample("kubellm_num_requests_waiting", name) == 0
        ttft = [g.first_token_s for g in finished]
        assert all(t is not None and t > 0 for t in ttft)
    finally:
        engine.stop()
