"""Batched generation for the model server: one worker thread, a bounded queue, a KV cache.

Every protocol (V1 predict, V2 infer, OpenAI completions and chat) turns a prompt into a
`GenerationRequest` and submits it here, so concurrent callers share forward passes instead
of queueing behind each other's `model.generate`.

The worker takes what is queued, up to `max_batch` requests. It waits up to `max_wait_ms` for
more only under concurrent load (requests queued while it was busy, and more than one of
them or several in the last batch: more are likely on their way); a request that finds the
worker idle, or one client's next request, starts at once, so a lone caller pays no batching
delay. The prompts are left-padded, with an attention mask and position ids
that count real tokens only, prefilled in one forward pass, then decoded one token per step
with a `DynamicCache`.

Static batching: requests that arrive during a batch wait for the next one. Within a batch
each row keeps its own max_tokens, stop strings, EOS, deadline and sampler (temperature,
top_p, and a `torch.Generator` seeded per request) and finishes on its own: finished rows are
dropped from the batch and from the cache (`Cache.batch_select_indices`), so the batch only
computes rows still decoding.

Greedy rows pick the argmax, as `model.generate` does; padding can change a logit's last
bits, so a batched greedy answer equals the unbatched one except where the top two logits
are nearly tied. Each result carries the smallest top1-top2 logit gap over its steps
(`Generation.min_margin`) so callers can tell such near-ties from real differences.

Beyond temperature and top_p, a request may ask for (`SamplingParams`, vLLM's semantics):
top_k (before top_p, sampled rows only), min_tokens (EOS logits masked to -inf, and stop
strings not looked for, until that many tokens were generated), ignore_eos (an EOS is kept as
a token and decoding goes on), logprobs for each generated token and prompt_logprobs for
each prompt token (from the prefill pass; max_tokens=0 then scores a prompt without
generating: lm-evaluation-harness's loglikelihood requests). Log-probabilities are the
log_softmax, in float32 over the whole vocabulary, of the model's raw logits at that step:
before temperature, top_k, top_p and the min_tokens mask (vLLM's default `raw_logprobs`).
All of that work is done only for the rows that ask: the full-vocabulary log_softmax per
step, torch.topk for top_k, the EOS mask; prompt logprobs make the prefill keep the logits
of every position (for the whole batch; the model computes them in one matmul).

Events reach callers through `emit`, called on the worker thread: `submit_async` wraps it in
`loop.call_soon_threadsafe` so coroutines await an `asyncio.Queue`. Nothing is logged per
token. The engine updates the Prometheus metrics of kubellm.serve.metrics (tokens, time to
first token, latency, finish reasons, queue depth and batch size) labelled with its
`model_name`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from kubellm.serve.metrics import EngineMetrics

FinishReason = Literal["stop", "length", "timeout", "cancelled"]


class QueueFull(RuntimeError):
    """The queue holds `max_queue` requests already: the server is busy (HTTP 503)."""


class RequestTimedOut(RuntimeError):
    """A request passed its deadline before it finished (HTTP 504)."""


class EngineStopped(RuntimeError):
    """The engine was stopped (the server is shutting down) before the request finished."""


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for; the protocol layer has validated the values (the checks
    here are a safety net: ValueError).

    - max_tokens: at most this many tokens; 0 only with prompt_logprobs (prefill only: the
      result has no tokens and finish_reason "length").
    - temperature: 0 is greedy (argmax; top_k, top_p and seed are then unused).
    - top_k: 0 is off; else sample among the k highest logits only, applied before top_p
      (HF's TopKLogitsWarper, vLLM).
    - min_tokens: neither EOS nor a stop string ends the request before this many tokens were
      generated: EOS logits are -inf for those steps (unless ignore_eos), and stop strings are
      looked for only in text that ends after the min_tokens-th token (vLLM).
    - ignore_eos: EOS does not end the request; a picked EOS is kept in `token_ids` (and
      logprobs) like any token, and decoding goes on to max_tokens or a stop string (vLLM's
      check_stop). `text` is decoded with skip_special_tokens, so it shows no EOS.
    - logprobs: None for none; k >= 0: each generated token's log-probability
      (`Generation.logprobs`) and the k most likely tokens of its step
      (`Generation.top_logprobs`, empty lists for k=0).
    - prompt_logprobs: None for none; k >= 0: the same for each prompt token after the first,
      given the tokens before it, from the prefill forward pass.

    Log-probabilities are log_softmax in float32 over the whole vocabulary of the model's raw
    logits at that position: before temperature, top_k, top_p and the min_tokens mask (vLLM's
    default logprobs mode, `raw_logprobs`).
    """

    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens < least:
            raise ValueError(f"max_tokens must be at least {least}, not {self.max_tokens}")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError(f"min_tokens must be 0..max_tokens, not {self.min_tokens}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k < 0:
                raise ValueError(f"{name} must be >= 0, not {k}")


TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class Generation:
    """One finished request. `text` is cut before a stop string and never holds EOS.

    The logprob fields are None unless the request asked (`SamplingParams.logprobs`,
    `prompt_logprobs`): then `logprobs[i]` belongs to `token_ids[i]` (an EOS that ended the
    request is not among them) and `top_logprobs[i]` lists up to k alternatives of that step;
    `prompt_logprobs[j]` belongs to `prompt_token_ids[j]`, None for the first prompt token.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: FinishReason
    min_margin: float  # smallest top1-top2 logit gap over the generated steps (inf: none)
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    first_token_s: float | None = None  # from submit to the first generated token


@dataclass(frozen=True)
class Delta:
    """Text decoded since the last delta (streaming requests only)."""

    text: str


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Delta | Generation | Failed


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 16
    max_wait_ms: float = 5.0
    max_queue: int = 256
    request_timeout_s: float = 60.0


@dataclass(eq=False)
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    stream: bool = False
    deadline: float = math.inf  # time.monotonic()
    cancelled: bool = False  # set by the caller (a client that went away); read by the worker
    # worker state
    tokens: list[int] = field(default_factory=list)
    min_margin: float = math.inf
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    done: bool = False
    generator: torch.Generator | None = None
    submitted: float = 0.0  # time.monotonic() at submit
    first_token_at: float | None = None
    stop_from: int = 0  # a stop string must end after this many characters (min_tokens)
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None

    def cancel(self) -> None:
        self.cancelled = True


class BatchEngine:
    """Owns the worker thread; `submit` and `submit_async` are safe from any thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        options: EngineOptions | None = None,
        *,
        model_name: str = "model",
    ) -> None:
        """`model_name` labels this engine's Prometheus series (the served model's name)."""
        self.model = model
        self.tokenizer = tokenizer
        self.options = options or EngineOptions()
        self.device = next(model.parameters()).device
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = {i for i in eos_ids if i is not None}
        self._eos_index: torch.Tensor | None = None  # eos_ids inside the vocabulary, on device
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        params = inspect.signature(model.forward).parameters
        # transformers 5 names the cache argument `cache`; older models and remote code
        # still take `past_key_values`
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params
        self._queue: deque[GenerationRequest] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_batch = 0  # rows in the batch taken last (a sign of concurrent callers)
        self.batches_run = 0  # for tests and metrics: how many batches, how many rows at most
        self.largest_batch = 0
        self.metrics = EngineMetrics(model_name)
        self._new_tokens = 0  # generated this step, for the metrics (one update per step)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kubellm-batch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the current step, fail what is left, and end the worker thread."""
        with self._cv:
            self._stopping = True
            pending = list(self._queue)
            self._queue.clear()
            self.metrics.waiting.set(0)
            self._cv.notify_all()
        for req in pending:
            self._fail(req, EngineStopped("the model server is stopping"))
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # -- submitting ------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue all of `requests` or none: QueueFull when they do not fit."""
        now = time.monotonic()
        with self._cv:
            if self._stopping or self._thread is None:
                raise EngineStopped("the model server is not running")
            if len(self._queue) + len(requests) > self.options.max_queue:
                raise QueueFull(
                    f"the request queue is full ({len(self._queue)} waiting, limit "
                    f"max_queue={self.options.max_queue}); retry later"
                )
            for req in requests:
                req.submitted = now
                if req.deadline == math.inf:
                    req.deadline = now + self.options.request_timeout_s
                self._queue.append(req)
            self.metrics.waiting.set(len(self._queue))
            self._cv.notify()

    def submit_async(
        self, prompts: Sequence[tuple[list[int], SamplingParams]], stream: bool = False
    ) -> tuple[list[GenerationRequest], asyncio.Queue[tuple[int, Event]]]:
        """Submit from a coroutine; events arrive on the returned queue as (index, event)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def emitter(index: int) -> Callable[[Event], None]:
            def emit(event: Event) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))

            return emit

        requests = [
            GenerationRequest(ids, params, emitter(i), stream=stream)
            for i, (ids, params) in enumerate(prompts)
        ]
        self.submit(requests)
        return requests, events

    async def generate(
        self, prompts: Sequence[tuple[list[int], SamplingParams]]
    ) -> list[Generation]:
        """Results in order (a late one has finish_reason "timeout"); raises what the worker
        failed with. Cancelling the caller cancels its rows."""
        requests, events = self.submit_async(prompts)
        results: list[Generation | None] = [None] * len(requests)
        try:
            remaining = len(requests)
            while remaining:
                index, event = await events.get()
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Generation):
                    results[index] = event
                    remaining -= 1
        finally:
            for req in requests:
                req.cancel()  # a no-op for finished rows; frees the batch if we were cancelled
        return [r for r in results if r is not None]

    def generate_sync(
        self, prompts: Sequence[tuple[list[int], SamplingParams]], timeout_s: float = 300.0
    ) -> list[Generation]:
        """For callers without an event loop (tests, scripts)."""
        done = threading.Event()
        results: list[Generation | None] = [None] * len(prompts)
        errors: list[BaseException] = []
        lock = threading.Lock()
        left = [len(prompts)]

        def emitter(index: int) -> Callable[[Event], None]:
            def emit(event: Event) -> None:
                if isinstance(event, Delta):
                    return
                with lock:
                    if isinstance(event, Failed):
                        errors.append(event.error)
                    else:
                        results[index] = event
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

            return emit

        self.submit([GenerationRequest(ids, p, emitter(i)) for i, (ids, p) in enumerate(prompts)])
        if not done.wait(timeout_s):
            raise TimeoutError(f"no result within {timeout_s:.0f}s")
        if errors:
            raise errors[0]
        return [r for r in results if r is not None]

    # -- the worker ------------------------------------------------------------------------

    def _take(self) -> list[GenerationRequest] | None:
        """The next batch, or None when stopping."""
        opts = self.options
        with self._cv:
            waited = False
            while not self._queue and not self._stopping:
                self._cv.wait()
                waited = True
            if self._stopping:
                return None
            # Found waiting on return from a batch, with company: more than one request
            # queued, or the last batch had several rows. Then there is concurrent load and
            # gathering a little longer pays. One client sending request after request also
            # finds its next request queued (it is sent while the worker still tidies up the
            # last batch), but alone: it must not wait.
            under_load = not waited and (len(self._queue) > 1 or self._last_batch > 1)
            batch = [self._queue.popleft() for _ in range(min(opts.max_batch, len(self._queue)))]
            if under_load and opts.max_wait_ms > 0:
                until = time.monotonic() + opts.max_wait_ms / 1000
                while len(batch) < opts.max_batch and not self._stopping:
                    if not self._queue:
                        left = until - time.monotonic()
                        if left <= 0:
                            break
                        self._cv.wait(left)
                        continue
                    batch.append(self._queue.popleft())
            self._last_batch = len(batch)
            self.metrics.waiting.set(len(self._queue))
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            live = []
            now = time.monotonic()
            for req in batch:
                if req.cancelled:
                    self._finish(req, "cancelled")
                elif now >= req.deadline:
                    self._finish(req, "timeout")
                else:
                    live.append(req)
            if not live:
                continue
            try:
                self._run(live)
            except Exception as err:  # a failed forward must not take the server down
                for req in live:
                    if not req.done:
                        self._fail(req, err)
            finally:
                self.metrics.running.set(0)

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
        every_position: bool = False,
    ) -> torch.Tensor:
        """The last position's logits in float32 ([rows, vocab]), or with `every_position`
        the model's logits of every position as it returns them ([rows, width, vocab])."""
        kwargs: dict[str, Any] = {self._cache_arg: cache}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 0 if every_position else 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        if every_position:
            return out.logits  # type: ignore[no-any-return]
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def _run(self, batch: list[GenerationRequest]) -> None:
        self.batches_run += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, req in enumerate(batch):
            n = len(req.prompt_ids)
            ids[row, width - n :] = torch.tensor(req.prompt_ids, dtype=torch.long)
            mask[row, width - n :] = 1
            if req.params.temperature > 0:
                req.generator = torch.Generator(device=self.device)
                if req.params.seed is not None:
                    req.generator.manual_seed(req.params.seed)
                else:
                    req.generator.seed()
        ids, mask = ids.to(self.device), mask.to(self.device)
        # positions count real tokens only, so a padded row sees the positions it would alone
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_ids) for r in batch))
        self.metrics.running.set(len(batch))
        if any(r.params.prompt_logprobs is not None for r in batch):
            every = self._forward(ids, mask, positions, cache, every_position=True)
            for row, req in enumerate(batch):
                if req.params.prompt_logprobs is not None:
                    self._score_prompt(req, every[row, width - len(req.prompt_ids) :])
            # a copy: a view would keep every position's logits alive while decoding
            logits = every[:, -1, :].to(torch.float32, copy=True)
            del every
        else:
            logits = self._forward(ids, mask, positions, cache)
        next_pos = positions[:, -1:] + 1
        rows = list(batch)
        # prefill only (max_tokens=0 with prompt_logprobs): done before picking a token
        keep = [i for i, req in enumerate(rows) if req.params.max_tokens > 0]
        for i in range(len(rows)):
            if rows[i].params.max_tokens <= 0:
                self._finish(rows[i], "length")
        if not keep:
            return
        if len(keep) < len(rows):
            rows, (mask, next_pos, logits) = self._drop(rows, keep, cache, mask, next_pos, logits)
        while True:
            tokens, step_logprobs = self._pick(logits, rows)
            picked = tokens.tolist()  # one device sync per step, not one per row
            keep = [
                i
                for i, req in enumerate(rows)
                if not self._advance(req, picked[i], step_logprobs.get(i))
            ]
            if self._new_tokens:
                self.metrics.generation_tokens.inc(self._new_tokens)
                self._new_tokens = 0
            if self._stopping:
                for i in keep:
                    self._fail(rows[i], EngineStopped("the model server is stopping"))
                return
            if not keep:
                return
            if len(keep) < len(rows):
                rows, (mask, next_pos, tokens) = self._drop(
                    rows, keep, cache, mask, next_pos, tokens
                )
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            logits = self._forward(tokens[:, None], mask, next_pos, cache)
            next_pos = next_pos + 1

    def _score_prompt(self, req: GenerationRequest, logits: torch.Tensor) -> None:
        """Prompt logprobs from `logits`, the prefill logits of the request's real (unpadded)
        positions: position j predicts prompt token j + 1."""
        k = req.params.prompt_logprobs or 0
        ids = req.prompt_ids
        req.prompt_logprobs, req.prompt_top_logprobs = [None], [None]
        if len(ids) < 2:
            return
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        target = torch.tensor(ids[1:], device=logprobs.device)
        req.prompt_logprobs += logprobs.gather(1, target[:, None])[:, 0].tolist()
        req.prompt_top_logprobs += _top(logprobs, k)

    def _drop(
        self,
        rows: list[GenerationRequest],
        keep: list[int],
        cache: Any,
        *tensors: torch.Tensor,
    ) -> tuple[list[GenerationRequest], tuple[torch.Tensor, ...]]:
        """Keep only rows `keep` (finished ones leave the batch): in the cache and in each
        per-row tensor."""
        index = torch.tensor(keep, device=self.device)
        cache.batch_select_indices(index)
        kept = [rows[i] for i in keep]
        self.metrics.running.set(len(kept))
        return kept, tuple(t[index] for t in tensors)

    def _pick(
        self, logits: torch.Tensor, rows: list[GenerationRequest]
    ) -> tuple[torch.Tensor, dict[int, tuple[float, TopLogprobs]]]:
        """The next token of each row (argmax, or a sample) and, for the rows that asked,
        its logprob and the step's top logprobs; records each row's logit gap."""
        want = [i for i, req in enumerate(rows) if req.params.logprobs is not None]
        raw = torch.log_softmax(logits[want], dim=-1) if want else None  # before any mask
        banned = [
            i
            for i, req in enumerate(rows)
            if len(req.tokens) < req.params.min_tokens and not req.params.ignore_eos
        ]
        if banned:  # min_tokens: no EOS yet
            eos = self._eos_on(logits)
            if eos.numel():
                logits[torch.tensor(banned, device=logits.device)[:, None], eos] = -math.inf
        tokens = logits.argmax(dim=-1)
        if logits.shape[-1] > 1:
            top2 = logits.topk(2, dim=-1).values
            gaps = (top2[:, 0] - top2[:, 1]).tolist()
            for req, gap in zip(rows, gaps, strict=True):
                req.min_margin = min(req.min_margin, gap)
        for i, req in enumerate(rows):
            if req.params.temperature > 0:
                tokens[i] = self._sample(logits[i], req)
        if raw is None:
            return tokens, {}
        chosen = raw.gather(1, tokens[want][:, None])[:, 0].tolist()
        k = max(rows[i].params.logprobs or 0 for i in want)
        tops = _top(raw, k)
        return tokens, {
            i: (lp, top[: rows[i].params.logprobs])
            for i, lp, top in zip(want, chosen, tops, strict=True)
        }

    def _eos_on(self, logits: torch.Tensor) -> torch.Tensor:
        """The EOS ids inside the vocabulary, on the logits' device (made once)."""
        if self._eos_index is None:
            vocab = logits.shape[-1]
            ids = sorted(i for i in self.eos_ids if 0 <= i < vocab)
            self._eos_index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        return self._eos_index

    def _sample(self, logits: torch.Tensor, req: GenerationRequest) -> int:
        top_k = req.params.top_k
        if 0 < top_k < logits.shape[-1]:
            values, order = logits.topk(top_k)  # sorted, highest first
            probs = torch.softmax(values / req.params.temperature, dim=-1)
            if req.params.top_p < 1.0:
                probs = probs.masked_fill(probs.cumsum(-1) - probs >= req.params.top_p, 0.0)
            return int(order[torch.multinomial(probs, 1, generator=req.generator)])
        probs = torch.softmax(logits / req.params.temperature, dim=-1)
        if req.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= req.params.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            pick = torch.multinomial(sorted_probs, 1, generator=req.generator)
            return int(order[pick])
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def _advance(
        self, req: GenerationRequest, token: int, logprob: tuple[float, TopLogprobs] | None
    ) -> bool:
        """Take one token for `req`; True when the request is finished (and told so)."""
        if req.cancelled:
            self._finish(req, "cancelled")
            return True
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            self.metrics.time_to_first_token.observe(req.first_token_at - req.submitted)
        if token in self.eos_ids and not req.params.ignore_eos:
            self._finish(req, "stop")
            return True
        req.tokens.append(token)
        self._new_tokens += 1
        if logprob is not None:
            if req.logprobs is None or req.top_logprobs is None:
                req.logprobs, req.top_logprobs = [], []
            req.logprobs.append(logprob[0])
            req.top_logprobs.append(logprob[1])
        stop = req.params.stop
        if stop or req.stream:
            req.text = self._decode(req.tokens)
            if stop and len(req.tokens) < req.params.min_tokens:
                req.stop_from = len(req.text)  # stop strings count only after min_tokens
            elif stop:
                cut = _find_stop(req.text, stop, req.emitted, req.stop_from)
                if cut is not None:
                    self._finish(req, "stop", req.text[:cut])
                    return True
        if len(req.tokens) >= req.params.max_tokens:
            self._finish(req, "length")
            return True
        if time.monotonic() >= req.deadline:
            self._finish(req, "timeout")
            return True
        if req.stream:
            safe = len(req.text) - _held_back(req.text, stop)
            if safe > req.emitted:
                req.emit(Delta(req.text[req.emitted : safe]))
                req.emitted = safe
        return False

    def _finish(
        self, req: GenerationRequest, reason: FinishReason, text: str | None = None
    ) -> None:
        """Tell the caller `req` is done; `text` when a stop string cut it."""
        req.done = True
        req.text = text if text is not None else self._decode(req.tokens) if req.tokens else ""
        if req.stream and len(req.text) > req.emitted:
            req.emit(Delta(req.text[req.emitted :]))
            req.emitted = len(req.text)
        now = time.monotonic()
        self.metrics.e2e_latency.observe(now - req.submitted)
        self.metrics.finished(reason)
        logprobs, top_logprobs = req.logprobs, req.top_logprobs
        if req.params.logprobs is not None and (logprobs is None or top_logprobs is None):
            logprobs, top_logprobs = [], []  # asked, but no token was generated
        scored = req.prompt_logprobs is not None
        req.emit(
            Generation(
                text=req.text,
                token_ids=list(req.tokens),
                prompt_tokens=len(req.prompt_ids),
                finish_reason=reason,
                min_margin=req.min_margin,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                prompt_token_ids=list(req.prompt_ids) if scored else None,
                prompt_logprobs=req.prompt_logprobs,
                prompt_top_logprobs=req.prompt_top_logprobs,
                first_token_s=(
                    None if req.first_token_at is None else req.first_token_at - req.submitted
                ),
            )
        )

    def _fail(self, req: GenerationRequest, error: BaseException) -> None:
        req.done = True
        self.metrics.finished("error")
        req.emit(Failed(error))

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


def _find_stop(text: str, stop: tuple[str, ...], start: int, end_after: int = 0) -> int | None:
    """Where the earliest stop string begins in `text` (searching from `start`, what was
    already streamed holds none) among those that end after `end_after` characters (text
    from before min_tokens cannot stop a request), or None."""
    hits = [i for s in stop if (i := text.find(s, max(start, end_after - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def _top(logprobs: torch.Tensor, k: int) -> list[TopLogprobs]:
    """The k most likely (token id, logprob) of each row of `logprobs`, highest first."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [
        list(zip(ids, values, strict=True))
        for ids, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)
    ]


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many trailing characters not to stream yet: an incomplete UTF-8 sequence (decoded
    as U+FFFD) or the start of a stop string that the next tokens may complete."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
