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

Events reach callers through `emit`, called on the worker thread: `submit_async` wraps it in
`loop.call_soon_threadsafe` so coroutines await an `asyncio.Queue`. Nothing is logged per
token.
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

FinishReason = Literal["stop", "length", "timeout", "cancelled"]


class QueueFull(RuntimeError):
    """The queue holds `max_queue` requests already: the server is busy (HTTP 503)."""


class RequestTimedOut(RuntimeError):
    """A request passed its deadline before it finished (HTTP 504)."""


class EngineStopped(RuntimeError):
    """The engine was stopped (the server is shutting down) before the request finished."""


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for; the protocol layer has validated the values."""

    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Generation:
    """One finished request. `text` is cut before a stop string and never holds EOS."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: FinishReason
    min_margin: float  # smallest top1-top2 logit gap over the generated steps (inf: none)


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

    def cancel(self) -> None:
        self.cancelled = True


class BatchEngine:
    """Owns the worker thread; `submit` and `submit_async` are safe from any thread."""

    def __init__(self, model: Any, tokenizer: Any, options: EngineOptions | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.options = options or EngineOptions()
        self.device = next(model.parameters()).device
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = {i for i in eos_ids if i is not None}
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
            self._cv.notify_all()
        for req in pending:
            req.emit(Failed(EngineStopped("the model server is stopping")))
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
                if req.deadline == math.inf:
                    req.deadline = now + self.options.request_timeout_s
                self._queue.append(req)
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
                        req.done = True
                        req.emit(Failed(err))

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_arg: cache}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
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
        logits = self._forward(ids, mask, positions, cache)
        next_pos = positions[:, -1:] + 1
        rows = list(batch)
        while True:
            tokens = self._pick(logits, rows)
            picked = tokens.tolist()  # one device sync per step, not one per row
            keep = [i for i, req in enumerate(rows) if not self._advance(req, picked[i])]
            if self._stopping:
                for i in keep:
                    rows[i].done = True
                    rows[i].emit(Failed(EngineStopped("the model server is stopping")))
                return
            if not keep:
                return
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, next_pos, tokens = mask[index], next_pos[index], tokens[index]
                rows = [rows[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            logits = self._forward(tokens[:, None], mask, next_pos, cache)
            next_pos = next_pos + 1

    def _pick(self, logits: torch.Tensor, rows: list[GenerationRequest]) -> torch.Tensor:
        """The next token of each row (argmax, or a sample); records each row's logit gap."""
        tokens = logits.argmax(dim=-1)
        if logits.shape[-1] > 1:
            top2 = logits.topk(2, dim=-1).values
            gaps = (top2[:, 0] - top2[:, 1]).tolist()
            for req, gap in zip(rows, gaps, strict=True):
                req.min_margin = min(req.min_margin, gap)
        for i, req in enumerate(rows):
            if req.params.temperature > 0:
                tokens[i] = self._sample(logits[i], req)
        return tokens

    def _sample(self, logits: torch.Tensor, req: GenerationRequest) -> int:
        probs = torch.softmax(logits / req.params.temperature, dim=-1)
        if req.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= req.params.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            pick = torch.multinomial(sorted_probs, 1, generator=req.generator)
            return int(order[pick])
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def _advance(self, req: GenerationRequest, token: int) -> bool:
        """Take one token for `req`; True when the request is finished (and told so)."""
        if req.cancelled:
            self._finish(req, "cancelled")
            return True
        if token in self.eos_ids:
            self._finish(req, "stop")
            return True
        req.tokens.append(token)
        stop = req.params.stop
        if stop or req.stream:
            req.text = self._decode(req.tokens)
            if stop:
                cut = _find_stop(req.text, stop, req.emitted)
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
        req.emit(
            Generation(
                text=req.text,
                token_ids=list(req.tokens),
                prompt_tokens=len(req.prompt_ids),
                finish_reason=reason,
                min_margin=req.min_margin,
            )
        )

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


def _find_stop(text: str, stop: tuple[str, ...], start: int) -> int | None:
    """Where the earliest stop string begins in `text` (searching from `start`, what was
    already streamed holds none), or None."""
    hits = [i for s in stop if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


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
