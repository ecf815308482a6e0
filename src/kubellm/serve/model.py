"""The served model: a Hugging Face causal LM behind KServe's V1 and V2 protocols and the
OpenAI-compatible API.

One `kserve.Model` answers V1 predict, V2 infer and readiness through kserve's data plane,
and the OpenAI requests that kubellm.serve.server's routes parse (kubellm.serve.protocol).
All of them submit to one BatchEngine (kubellm.serve.engine), so they batch together:

    POST /v1/models/NAME:predict  {"instances": ["12+7=", {"prompt": "3+4=", "max_new_tokens": 4}]}
                                  -> {"predictions": ["19", "7"]}
    POST /v2/models/NAME/infer    {"inputs": [{"name": "text_input", "datatype": "BYTES",
                                    "shape": [1], "data": ["12+7="]}],
                                   "parameters": {"max_tokens": 4}}
                                  -> {"outputs": [{"name": "text_output", "shape": [1], ...}]}
    POST /openai/v1/completions   {"model": NAME, "prompt": "12+7=", "max_tokens": 4,
                                   "temperature": 0}
    POST /openai/v1/chat/completions, GET /openai/v1/models, GET /openai/v1/models/NAME

V1 and V2 are greedy and answer stripped text (what `generate.complete` returns, so the smoke
test can compare); OpenAI requests sample as asked and get the text as generated.

How many tokens a request may ask for is bounded by the model's context: the prompt's tokens
plus max_tokens must fit in it (a 400 with the numbers otherwise), and an OpenAI chat request
without max_tokens may use all that is left (OpenAI completions default to 16 tokens, V1/V2
to 8). `max_tokens_limit` (`--max-tokens-limit`, unset by default) is an operator's cap on
top of that: asking for more (max_tokens, or a min_tokens above it) is a 400, and it caps
chat's default.

Before any work a prompt is checked by its length in characters: no token stands for more
than `chars_per_token` characters (the longest entry of the vocabulary, doubled for
normalizers that fold characters together), so a prompt longer than context_length x
chars_per_token characters cannot fit and is refused (400) without being tokenized.
Long prompts are tokenized (and chat templates rendered) on a worker thread, off the event
loop, so a large request does not stall the others.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import kserve
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from kserve.utils.utils import generate_uuid

from kubellm.serve import protocol
from kubellm.serve.engine import (
    BatchEngine,
    EngineOptions,
    EngineStopped,
    Failed,
    Generation,
    GenerationRequest,
    RequestTimedOut,
    SamplingParams,
    TopLogprobs,
)
from kubellm.serve.engine import Delta as TokenDelta
from kubellm.serve.generate import load_model
from kubellm.serve.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    chat_messages,
)

DEFAULT_NEW_TOKENS = 8  # V1/V2 without max_new_tokens / max_tokens
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI completions without max_tokens (OpenAI's default)
MAX_INSTANCES = MAX_PROMPTS  # prompts in one request (V1 instances, V2 text_input)
INLINE_CHARS = 4096  # prompts up to this many characters are tokenized on the event loop

__all__ = ["CausalLMModel", "Instance", "RequestError", "parse_instances"]

T = TypeVar("T")
FinishReason = Literal["stop", "length"]  # OpenAI's


# -- V1 and V2 fields -----------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_str_or_strs(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


V2_PARAMETERS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_is_int, "an integer"),
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "seed": (_is_int, "an integer"),
    "stop": (_is_str_or_strs, "a string or a list of strings"),
}


def check_v2_parameters(params: dict[str, Any]) -> None:
    """V2 `parameters` as their JSON types: no "5" for 5, no true for 1 (null is unset)."""
    for name, value in params.items():
        rule = V2_PARAMETERS.get(name)
        if rule is None or value is None:
            continue
        ok, expected = rule
        if not ok(value):
            raise RequestError(
                name, f"parameters.{name} must be {expected}, not {json.dumps(value, default=str)}"
            )


@dataclass(frozen=True)
class Instance:
    prompt: str
    max_new_tokens: int


def parse_instances(payload: Any, limit: int | None = None) -> list[Instance]:
    """The V1 instances, each with its own max_new_tokens; InvalidInput naming the field.
    `limit`: the server's --max-tokens-limit (None: only the context bounds it)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("instances"), list):
        raise InvalidInput('expected a JSON object with an "instances" list')
    instances = payload["instances"]
    if not instances or len(instances) > MAX_INSTANCES:
        raise InvalidInput(f'"instances" must hold 1 to {MAX_INSTANCES} items')
    out: list[Instance] = []
    for i, inst in enumerate(instances):
        if isinstance(inst, str):
            inst = {"prompt": inst}
        if not isinstance(inst, dict) or not isinstance(inst.get("prompt"), str):
            raise InvalidInput(f'instances[{i}] must be a string or have a string "prompt"')
        if inst["prompt"] == "":
            raise InvalidInput(f"instances[{i}].prompt is empty: there is nothing to continue")
        value = inst.get("max_new_tokens", DEFAULT_NEW_TOKENS)
        if not _is_int(value) or value < 1 or (limit is not None and value > limit):
            bound = f"1..{limit}" if limit is not None else ">= 1"
            raise InvalidInput(
                f"instances[{i}].max_new_tokens must be an integer {bound}, "
                f"not {json.dumps(value, default=str)}"
            )
        out.append(Instance(inst["prompt"], value))
    return out


def _v2_strings(tensor: Any) -> list[str]:
    """A BYTES tensor's strings: JSON data (strings) or binary data (bytes)."""
    data = tensor.as_numpy().reshape(-1).tolist() if tensor.data is None else tensor.data
    out = []
    for item in _flatten(data):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput("text_input holds bytes that are not UTF-8") from None
        if not isinstance(item, str):
            raise InvalidInput(f"text_input must hold strings, not {type(item).__name__}")
        out.append(item)
    return out


def _flatten(data: Any) -> list[Any]:
    if isinstance(data, list):
        return [x for item in data for x in _flatten(item)]
    return [data]


# -- the model ------------------------------------------------------------------------------


class CausalLMModel(kserve.Model):  # type: ignore[misc]
    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        trust_remote_code: bool = False,
        options: EngineOptions | None = None,
        max_tokens_limit: int | None = None,
    ) -> None:
        super().__init__(name)
        self.model_dir = Path(model_dir)
        self.trust_remote_code = trust_remote_code
        self.options = options or EngineOptions()
        self.max_tokens_limit = max_tokens_limit
        self.model: Any = None
        self.tokenizer: Any = None
        self.batch_engine: BatchEngine | None = None  # `engine` is kserve's flag
        self.context_length = 0
        self.vocab_size = 0
        self.chars_per_token = 0
        self._backend: Any = None  # the fast tokenizer's tokenizers.Tokenizer, set by load
        self.created = 0
        self._token_text: dict[int, str] = {}  # token id -> its text, for logprobs

    def load(self) -> bool:
        self.model, self.tokenizer = load_model(self.model_dir, self.trust_remote_code)
        config = self.model.config
        self.context_length = int(
            getattr(config, "max_position_embeddings", 0)
            or getattr(self.tokenizer, "model_max_length", 0)
            or 2**31
        )
        self.vocab_size = int(getattr(config, "vocab_size", 0) or len(self.tokenizer))
        # byte-level BPE spells a token with one character per byte, SentencePiece and
        # WordPiece with its characters plus a marker: no vocabulary entry is shorter than
        # the text it stands for. Doubled: normalizers may fold a few characters into one.
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.chars_per_token = 2 * max(longest, 1)
        # A fast tokenizer's own `tokenizers.Tokenizer`: the same ids as calling the
        # transformers wrapper (tests/serve/test_model.py), without its per-call Python work,
        # which was a tenth of the event loop's time per request (docs/benchmarks-serve.md).
        self._backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self.batch_engine = BatchEngine(
            self.model, self.tokenizer, self.options, model_name=self.name
        )
        self.batch_engine.start()
        self.created = int(time.time())
        self.ready = True
        return True

    def stop(self) -> None:
        if self.batch_engine is not None:
            self.batch_engine.stop()
        self.ready = False

    def get_input_types(self) -> list[dict[str, Any]]:
        return [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict[str, Any]]:
        return [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]

    def card(self) -> protocol.ModelCard:
        """What GET /openai/v1/models lists for this model."""
        return protocol.ModelCard(
            id=self.name, created=self.created, max_model_len=self.context_length
        )

    # -- prompts ----------------------------------------------------------------------------

    @property
    def _engine(self) -> BatchEngine:
        if self.batch_engine is None:
            raise EngineStopped(f"model {self.name} is not loaded")
        return self.batch_engine

    def _check_chars(self, chars: int, field: str) -> None:
        """Refuse, without tokenizing, a prompt too long in characters to fit the context."""
        most = self.context_length * self.chars_per_token
        if chars > most:
            raise RequestError(
                field,
                f"{field} is {chars} characters: more than the model's context length of "
                f"{self.context_length} tokens can hold (at most {self.chars_per_token} "
                "characters a token)",
            )

    def _encode(self, prompt: str, field: str) -> list[int]:
        if prompt == "":
            raise RequestError(field, f"{field} is empty: there is nothing to continue")
        ids: list[int] = (
            self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if self._backend is None
            else self._backend.encode(prompt, add_special_tokens=False).ids
        )
        if not ids:
            raise RequestError(field, f"{field} has no tokens")
        return ids

    async def _off_loop(self, chars: int, work: Callable[[], T]) -> T:
        """`work()` inline when the text is short, else on a worker thread."""
        if chars <= INLINE_CHARS:
            return work()
        return await asyncio.to_thread(work)

    async def _tokenize(self, prompts: Sequence[tuple[str, str]]) -> list[list[int]]:
        """(prompt, field) -> token ids, each first checked by its length in characters."""
        for text, field in prompts:
            self._check_chars(len(text), field)
        return await self._off_loop(
            sum(len(t) for t, _ in prompts), lambda: [self._encode(t, f) for t, f in prompts]
        )

    def _check_ids(self, ids: list[int], field: str) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                field,
                f"{field} holds token id {bad}, outside the vocabulary 0..{self.vocab_size - 1}",
            )
        return ids

    def _fit(
        self,
        prompt_tokens: int,
        asked: int | None,
        field: str,
        name: str = "max_tokens",
        default: int | None = None,
        min_tokens: int = 0,
    ) -> int:
        """The max_tokens a request gets: the one asked for if it fits the context (and
        --max-tokens-limit), else a RequestError with the numbers; unasked, `default` or,
        without one, all the room the context leaves."""
        ctx, limit = self.context_length, self.max_tokens_limit
        room = ctx - prompt_tokens
        if asked is None:
            if room < max(1, min_tokens):
                raise RequestError(
                    field,
                    f"{field} has {prompt_tokens} tokens: no room to generate "
                    f"{max(1, min_tokens)} within the model's context length of {ctx} tokens",
                )
            n = room if default is None else min(max(default, min_tokens), room)
            if limit is not None and min_tokens > limit:
                raise RequestError(
                    "min_tokens",
                    f"min_tokens is {min_tokens}: more than this server's limit of {limit} tokens",
                )
            return n if limit is None else min(n, limit)
        if limit is not None and asked > limit:
            raise RequestError(
                name, f"{name} is {asked}: more than this server's limit of {limit} tokens"
            )
        if prompt_tokens + asked > ctx:
            raise RequestError(
                field,
                f"{field} has {prompt_tokens} tokens and {name} is {asked}: "
                f"{prompt_tokens + asked} tokens, beyond the model's context length of "
                f"{ctx} tokens",
            )
        return asked

    def _timeout_message(self) -> str:
        return (
            f"the request did not finish within request_timeout_s="
            f"{self.options.request_timeout_s:g}s"
        )

    async def _generate(self, prompts: Sequence[tuple[list[int], SamplingParams]]) -> list[str]:
        """Stripped greedy answers for V1/V2; a late request is RequestTimedOut (504)."""
        results = await self._engine.generate(prompts)
        if any(r.finish_reason == "timeout" for r in results):
            raise RequestTimedOut(self._timeout_message())
        return [r.text.strip() for r in results]

    # -- V1 and V2 ------------------------------------------------------------------------

    async def predict(
        self,
        payload: Any,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> dict[str, Any] | InferResponse:
        if isinstance(payload, InferRequest):
            return await self._infer_v2(payload)
        instances = parse_instances(payload, self.max_tokens_limit)
        prompts = []
        try:
            fields = [f"instances[{i}].prompt" for i in range(len(instances))]
            encoded = await self._tokenize(
                [(inst.prompt, f) for inst, f in zip(instances, fields, strict=True)]
            )
            for inst, field, ids in zip(instances, fields, encoded, strict=True):
                n = self._fit(len(ids), inst.max_new_tokens, field, "max_new_tokens")
                prompts.append((ids, SamplingParams(max_tokens=n)))
        except RequestError as err:
            raise InvalidInput(str(err)) from None
        return {"predictions": await self._generate(prompts)}

    async def _infer_v2(self, request: InferRequest) -> InferResponse:
        """text_input (BYTES [n]) -> text_output (BYTES [n]); sampling from `parameters`."""
        tensor = request.get_input_by_name("text_input")
        if tensor is None:
            raise InvalidInput('inputs must hold a "text_input" tensor (BYTES, shape [n])')
        if tensor.datatype != "BYTES":
            raise InvalidInput(f"text_input.datatype must be BYTES, not {tensor.datatype}")
        texts = _v2_strings(tensor)
        if not texts or len(texts) > MAX_INSTANCES:
            raise InvalidInput(f"text_input must hold 1 to {MAX_INSTANCES} strings")
        if list(tensor.shape) != [len(texts)]:
            raise InvalidInput(f"text_input.shape is {tensor.shape}, not [{len(texts)}]")
        params = dict(request.parameters or {})
        prompts = []
        try:
            check_v2_parameters(params)
            asked = params.get("max_tokens", DEFAULT_NEW_TOKENS)
            sampling = _v2_sampling(params)
            if asked < 1:
                raise RequestError("max_tokens", f"parameters.max_tokens must be >= 1, not {asked}")
            fields = [f"text_input[{i}]" for i in range(len(texts))]
            encoded = await self._tokenize(list(zip(texts, fields, strict=True)))
            for field, ids in zip(fields, encoded, strict=True):
                n = self._fit(len(ids), asked, field, "parameters.max_tokens")
                prompts.append((ids, SamplingParams(max_tokens=n, **sampling)))
        except RequestError as err:
            raise InvalidInput(str(err)) from None
        answers = await self._generate(prompts)
        output = InferOutput(name="text_output", shape=[len(answers)], datatype="BYTES")
        output.data = answers
        return InferResponse(
            response_id=request.id or generate_uuid(),
            model_name=self.name,
            infer_outputs=[output],
        )

    # -- OpenAI ---------------------------------------------------------------------------

    def _render_chat(self, messages: list[dict[str, str]]) -> str:
        """The tokenizer's own chat template, with the assistant's turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "messages",
                f"model {self.name} has no chat template (tokenizer_config.json chat_template): "
                "use /openai/v1/completions",
            )
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # jinja2 errors: the template refused these messages
            raise RequestError("messages", f"the chat template rejected messages: {err}") from None
        return str(prompt)

    def _sampling(
        self, request: protocol.OpenAIRequest, max_tokens: int, **logprobs: int | None
    ) -> SamplingParams:
        """The engine's parameters; unasked temperature and top_p from the model's
        generation config (greedy unless it samples)."""
        temperature, top_p = request.temperature, request.top_p
        if temperature is None:
            gen = getattr(self.model, "generation_config", None)
            sample = bool(getattr(gen, "do_sample", False))
            temperature = float(getattr(gen, "temperature", None) or 1.0) if sample else 0.0
            if top_p is None and sample:
                top_p = getattr(gen, "top_p", None)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            seed=request.seed,
            stop=request.stops,
            top_k=max(request.top_k, 0),
            min_tokens=min(request.min_tokens, max_tokens),
            ignore_eos=request.ignore_eos,
            **logprobs,
        )

    async def create_completion(
        self, request: CompletionRequest
    ) -> protocol.Completion | AsyncIterator[str]:
        """Raises RequestError (400), QueueFull or EngineStopped (503), RequestTimedOut (504)."""
        prompts = request.prompts
        fields = ["prompt" if len(prompts) == 1 else f"prompt[{i}]" for i in range(len(prompts))]
        if isinstance(prompts[0], str):
            texts = [p for p in prompts if isinstance(p, str)]
            encoded = await self._tokenize(list(zip(texts, fields, strict=True)))
            echoes = texts
        else:
            encoded = [self._check_ids(list(p), f) for p, f in zip(prompts, fields, strict=True)]
            echoes = [self.tokenizer.decode(ids) for ids in encoded] if request.echo else []
        name, asked = request.asked_tokens
        k = request.logprobs
        submitted = []
        for ids, field in zip(encoded, fields, strict=True):
            n = self._fit(
                len(ids), asked, field, name, DEFAULT_COMPLETION_TOKENS, request.min_tokens
            )
            # echo scores the prompt (from the prefill); max_tokens 0 only scores it
            scored = k if k is not None else 0 if n == 0 else None
            prompt_logprobs = scored if request.echo else None
            submitted.append(
                (ids, self._sampling(request, n, logprobs=k, prompt_logprobs=prompt_logprobs))
            )
        echo = echoes if request.echo else None
        cid, created = f"cmpl-{generate_uuid()}", int(time.time())
        if request.stream:
            requests, events = self._engine.submit_async(submitted, stream=True)
            return self._completion_stream(cid, created, requests, events, echo, request)
        results = await self._collect(submitted)
        choices = []
        for i, r in enumerate(results):
            choices.append(
                protocol.CompletionChoice(
                    index=i,
                    text=(echo[i] if echo else "") + r.text,
                    logprobs=None if k is None else self._completion_logprobs(r, request.echo),
                    finish_reason=_finish_reason(r),
                )
            )
        return protocol.Completion(
            id=cid, created=created, model=self.name, choices=choices, usage=_usage(results)
        )

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> protocol.ChatCompletion | AsyncIterator[str]:
        """Raises RequestError (400), QueueFull or EngineStopped (503), RequestTimedOut (504)."""
        messages = chat_messages(request.messages)
        chars = sum(len(m["content"]) for m in messages)
        self._check_chars(chars, "messages")

        def render() -> tuple[str, list[int]]:
            prompt = self._render_chat(messages)
            return prompt, self._encode(prompt, "messages")

        _, ids = await self._off_loop(chars, render)
        name, asked = request.asked_tokens
        n = self._fit(len(ids), asked, "messages", name, None, request.min_tokens)
        k = (request.top_logprobs or 0) if request.logprobs else None
        submitted = [(ids, self._sampling(request, n, logprobs=k))]
        cid, created = f"chatcmpl-{generate_uuid()}", int(time.time())
        if request.stream:
            requests, events = self._engine.submit_async(submitted, stream=True)
            return self._chat_stream(cid, created, requests, events, request.include_usage)
        (result,) = await self._collect(submitted)
        logprobs = None
        if k is not None:
            logprobs = protocol.ChoiceLogprobs(content=self._chat_logprobs(result))
        choice = protocol.ChatChoice(
            index=0,
            message=protocol.ChatMessage(content=result.text),
            logprobs=logprobs,
            finish_reason=_finish_reason(result),
        )
        return protocol.ChatCompletion(
            id=cid, created=created, model=self.name, choices=[choice], usage=_usage([result])
        )

    async def _collect(self, submitted: list[tuple[list[int], SamplingParams]]) -> list[Generation]:
        """The finished generations, in order; a late one is RequestTimedOut. Cancelled
        (their rows freed) if the caller goes away first."""
        done = await self._engine.generate(submitted)
        if any(r.finish_reason == "timeout" for r in done):
            raise RequestTimedOut(self._timeout_message())
        return done

    # -- logprobs -------------------------------------------------------------------------

    def _text_of(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = str(self.tokenizer.decode([token]))
        return text

    def _top_dict(self, token: int, logprob: float, top: TopLogprobs) -> dict[str, float]:
        """The k most likely tokens and the token itself (OpenAI: up to k + 1 entries)."""
        out = {self._text_of(t): lp for t, lp in top}
        out.setdefault(self._text_of(token), logprob)
        return out

    def _completion_logprobs(self, r: Generation, echo: bool) -> protocol.CompletionLogprobs:
        tokens: list[int] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if echo and r.prompt_token_ids is not None:
            plps = r.prompt_logprobs or []
            ptops = r.prompt_top_logprobs or []
            for j, token in enumerate(r.prompt_token_ids):
                lp, top = plps[j] if j < len(plps) else None, ptops[j] if j < len(ptops) else None
                tokens.append(token)
                logprobs.append(lp)
                tops.append(None if lp is None else self._top_dict(token, lp, top or []))
        for token, lp, top in zip(
            r.token_ids, r.logprobs or [], r.top_logprobs or [], strict=False
        ):
            tokens.append(token)
            logprobs.append(lp)
            tops.append(self._top_dict(token, lp, top))
        texts = [self._text_of(t) for t in tokens]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return protocol.CompletionLogprobs(
            tokens=texts, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets
        )

    def _chat_logprobs(self, r: Generation) -> list[protocol.TokenLogprob]:
        def entry(token: int, lp: float) -> dict[str, Any]:
            text = self._text_of(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return [
            protocol.TokenLogprob(
                **entry(token, lp),
                top_logprobs=[protocol.TopLogprob(**entry(t, tlp)) for t, tlp in top],
            )
            for token, lp, top in zip(
                r.token_ids, r.logprobs or [], r.top_logprobs or [], strict=False
            )
        ]

    # -- streams --------------------------------------------------------------------------

    async def _events(
        self, requests: list[GenerationRequest], events: Any
    ) -> AsyncIterator[tuple[int, TokenDelta | Generation | Failed]]:
        """(index, event) until every request is done or one failed (the last event then).
        Cancels the requests however it ends (a client that went away frees its rows)."""
        try:
            left = len(requests)
            while left:
                index, event = await events.get()
                yield index, event
                if isinstance(event, Failed):
                    return
                if isinstance(event, Generation):
                    left -= 1
        finally:
            for req in requests:
                req.cancel()

    async def _completion_stream(
        self,
        cid: str,
        created: int,
        requests: list[GenerationRequest],
        events: Any,
        echo: list[str] | None,
        request: CompletionRequest,
    ) -> AsyncIterator[str]:
        """Server-sent events: the echoed prompt if asked, a chunk per decoded piece, a last
        chunk per choice with its finish_reason, the usage if asked, then [DONE]."""

        def chunk(index: int, text: str, finish: FinishReason | None = None) -> str:
            choice = protocol.CompletionChoice(index=index, text=text, finish_reason=finish)
            body = protocol.Completion(id=cid, created=created, model=self.name, choices=[choice])
            return _sse(body)

        for i, text in enumerate(echo or []):
            yield chunk(i, text)
        results = []
        async for index, event in self._events(requests, events):
            if isinstance(event, Failed):
                yield _sse(protocol.error_body(503, str(event.error)))
                break
            if isinstance(event, TokenDelta):
                yield chunk(index, event.text)
            else:
                results.append(event)
                yield chunk(index, "", _finish_reason(event))
        else:
            if request.include_usage:
                yield _sse(
                    protocol.Completion(
                        id=cid, created=created, model=self.name, choices=[], usage=_usage(results)
                    )
                )
        yield "data: [DONE]\n\n"

    async def _chat_stream(
        self,
        cid: str,
        created: int,
        requests: list[GenerationRequest],
        events: Any,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        def chunk(delta: protocol.ChatDelta, finish: FinishReason | None = None) -> str:
            choice = protocol.ChatChunkChoice(index=0, delta=delta, finish_reason=finish)
            return _sse(
                protocol.ChatCompletionChunk(
                    id=cid, created=created, model=self.name, choices=[choice]
                )
            )

        yield chunk(protocol.ChatDelta(role="assistant", content=""))
        results = []
        async for _, event in self._events(requests, events):
            if isinstance(event, Failed):
                yield _sse(protocol.error_body(503, str(event.error)))
                break
            if isinstance(event, TokenDelta):
                yield chunk(protocol.ChatDelta(content=event.text))
            else:
                results.append(event)
                yield chunk(protocol.ChatDelta(), _finish_reason(event))
        else:
            if include_usage:
                yield _sse(
                    protocol.ChatCompletionChunk(
                        id=cid, created=created, model=self.name, choices=[], usage=_usage(results)
                    )
                )
        yield "data: [DONE]\n\n"


def _v2_sampling(params: dict[str, Any]) -> dict[str, Any]:
    """V2 `parameters` (types checked) as SamplingParams fields, range-checked."""
    temperature = float(params.get("temperature") or 0.0)
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("temperature", f"parameters.temperature must be 0..2, not {temperature}")
    top_p = float(params["top_p"]) if params.get("top_p") is not None else 1.0
    if not 0.0 < top_p <= 1.0:
        raise RequestError("top_p", f"parameters.top_p must be in (0, 1], not {top_p}")
    stop = params.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > protocol.MAX_STOP or any(s == "" for s in stops):
        raise RequestError(
            "stop", f"parameters.stop must be up to {protocol.MAX_STOP} non-empty strings"
        )
    return {"temperature": temperature, "top_p": top_p, "seed": params.get("seed"), "stop": stops}


def _sse(body: Any) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def _finish_reason(g: Generation) -> FinishReason:
    # a stream cut by its deadline ends as if it ran out of tokens
    return "stop" if g.finish_reason == "stop" else "length"


def _usage(results: Sequence[Generation]) -> protocol.Usage:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(len(r.token_ids) for r in results)
    return protocol.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
