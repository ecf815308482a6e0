"""The served model: a Hugging Face causal LM behind KServe's V1, V2 and OpenAI protocols.

One object is both a `kserve.Model` (V1 predict, V2 infer, readiness) and kserve's
`OpenAIChatAdapterModel`, for which ModelServer also registers the OpenAI-compatible routes.
All of them submit to one BatchEngine (kubellm.serve.engine), so they batch together:

    POST /v1/models/NAME:predict  {"instances": ["12+7=", {"prompt": "3+4=", "max_new_tokens": 4}]}
                                  -> {"predictions": ["19", "7"]}
    POST /v2/models/NAME/infer    {"inputs": [{"name": "text_input", "datatype": "BYTES",
                                    "shape": [1], "data": ["12+7="]}],
                                   "parameters": {"max_tokens": 4}}
                                  -> {"outputs": [{"name": "text_output", "shape": [1], ...}]}
    POST /openai/v1/completions   {"model": NAME, "prompt": "12+7=", "max_tokens": 4,
                                   "temperature": 0}
    POST /openai/v1/chat/completions, GET /openai/v1/models

V1 and V2 are greedy and answer stripped text (what `generate.complete` returns, so the smoke
test can compare); OpenAI requests sample as asked and get the text as generated.

Bad input is a 4xx that names the field (V1/V2: 400 {"error": ...}; OpenAI: 400 with
error.param, or FastAPI's 422 for what its schema already rejects). pydantic would quietly
coerce "5" to 5 on the OpenAI routes, so the raw JSON body's types are checked too.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, TypeAlias

import kserve
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from kserve.protocol.rest.openai import ChatPrompt, OpenAIChatAdapterModel
from kserve.protocol.rest.openai.errors import create_error_response
from kserve.protocol.rest.openai.types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    ErrorResponse,
    UsageInfo,
)
from kserve.utils.utils import generate_uuid

from kubellm.serve.engine import (
    BatchEngine,
    EngineOptions,
    EngineStopped,
    Failed,
    Generation,
    GenerationRequest,
    QueueFull,
    RequestTimedOut,
    SamplingParams,
)
from kubellm.serve.engine import Delta as TokenDelta
from kubellm.serve.generate import load_model

MAX_NEW_TOKENS = 256  # the default --max-tokens-limit: most tokens one request may ask for
DEFAULT_NEW_TOKENS = 8  # V1/V2 without max_new_tokens / max_tokens
DEFAULT_OPENAI_TOKENS = 16  # OpenAI without max_tokens (the OpenAI default), if it fits
MAX_INSTANCES = 256  # prompts in one request (V1 instances, V2 text_input, OpenAI prompt list)
MAX_STOP = 4  # stop strings per request, as OpenAI allows

CompletionResult: TypeAlias = AsyncGenerator[str, None] | Completion | ErrorResponse
ChatResult: TypeAlias = AsyncGenerator[str, None] | ChatCompletion | ErrorResponse


class RequestError(ValueError):
    """A bad request: `field` names what is wrong, the message says how."""

    def __init__(self, field: str, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.field = field
        self.status = status


# -- field checks shared by the three protocols ---------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_str_or_strs(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "prompt": (_is_str_or_strs, "a string or a list of strings"),
    "messages": (lambda v: isinstance(v, list), "a list of messages"),
    "max_tokens": (_is_int, "an integer"),
    "max_completion_tokens": (_is_int, "an integer"),
    "max_new_tokens": (_is_int, "an integer"),
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "seed": (_is_int, "an integer"),
    "n": (_is_int, "an integer"),
    "stop": (_is_str_or_strs, "a string or a list of strings"),
    "stream": (lambda v: isinstance(v, bool), "true or false"),
}


def check_types(fields: Mapping[str, Any], prefix: str = "") -> None:
    """JSON types as the protocol states them: no "5" for 5, no true for 1 (null is unset)."""
    for name, value in fields.items():
        rule = FIELD_TYPES.get(name)
        if rule is None or value is None:
            continue
        ok, expected = rule
        if not ok(value):
            raise RequestError(
                name, f"{prefix}{name} must be {expected}, not {json.dumps(value, default=str)}"
            )


def sampling_params(
    *,
    max_tokens: int,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: str | list[str] | None,
    limit: int,
    prefix: str = "",
    max_tokens_name: str = "max_tokens",
) -> SamplingParams:
    """Range checks, then the engine's parameters."""
    if not 1 <= max_tokens <= limit:
        raise RequestError(
            max_tokens_name, f"{prefix}{max_tokens_name} must be 1..{limit}, not {max_tokens}"
        )
    temperature = 0.0 if temperature is None else float(temperature)
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("temperature", f"{prefix}temperature must be 0..2, not {temperature}")
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise RequestError("top_p", f"{prefix}top_p must be in (0, 1], not {top_p}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP or any(s == "" for s in stops):
        raise RequestError("stop", f"{prefix}stop must be up to {MAX_STOP} non-empty strings")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stops)
    )


# -- V1 -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    prompt: str
    max_new_tokens: int


def parse_instances(payload: Any, limit: int = MAX_NEW_TOKENS) -> list[Instance]:
    """The V1 instances, each with its own max_new_tokens; InvalidInput naming the field."""
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
        if not _is_int(value) or not 1 <= value <= limit:
            raise InvalidInput(
                f"instances[{i}].max_new_tokens must be an integer 1..{limit}, "
                f"not {json.dumps(value, default=str)}"
            )
        out.append(Instance(inst["prompt"], value))
    return out


# -- chat -----------------------------------------------------------------------------------


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI messages as the role/content dicts chat templates take (text parts only)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of {role, content}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestError("messages", f"messages[{i}] must be an object with role, content")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RequestError("messages", f"messages[{i}].role must be a non-empty string")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    raise RequestError(
                        "messages", f"messages[{i}].content[{j}]: only text parts are supported"
                    )
                texts.append(str(part.get("text", "")))
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise RequestError(
                "messages", f"messages[{i}].content must be a string or a list of text parts"
            )
        out.append({"role": role, "content": content})
    return out


async def _raw_body(raw_request: Any) -> dict[str, Any]:
    """The request's JSON as sent (FastAPI has read it already; Starlette caches it)."""
    if raw_request is None:
        return {}
    try:
        body = await raw_request.json()
    except Exception:  # not JSON: FastAPI would have answered 422 before we ran
        return {}
    return body if isinstance(body, dict) else {}


def _error(err: RequestError | str, status: HTTPStatus, param: str = "") -> ErrorResponse:
    kind = {
        HTTPStatus.BAD_REQUEST: "BadRequestError",
        HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
        HTTPStatus.GATEWAY_TIMEOUT: "TimeoutError",
    }.get(status, "Error")
    param = param.split("[")[0]  # "prompt[1]" -> the field "prompt"; the message says which
    return create_error_response(str(err), err_type=kind, param=param, status_code=status)


def _finish_reason(g: Generation) -> str:
    # a stream cut by its deadline ends as if it ran out of tokens
    return "stop" if g.finish_reason == "stop" else "length"


class CausalLMModel(kserve.Model, OpenAIChatAdapterModel):  # type: ignore[misc]
    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        trust_remote_code: bool = False,
        options: EngineOptions | None = None,
        max_tokens_limit: int = MAX_NEW_TOKENS,
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
        self.ready = False  # OpenAIModel.__init__ assumes ready; nothing is loaded yet

    def load(self) -> bool:
        self.model, self.tokenizer = load_model(self.model_dir, self.trust_remote_code)
        config = self.model.config
        self.context_length = int(
            getattr(config, "max_position_embeddings", 0)
            or getattr(self.tokenizer, "model_max_length", 0)
            or 2**31
        )
        self.batch_engine = BatchEngine(self.model, self.tokenizer, self.options)
        self.batch_engine.start()
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

    # -- shared ---------------------------------------------------------------------------

    @property
    def _engine(self) -> BatchEngine:
        if self.batch_engine is None:
            raise EngineStopped(f"model {self.name} is not loaded")
        return self.batch_engine

    def _encode(self, prompt: str, field: str) -> list[int]:
        if prompt == "":
            raise RequestError(field, f"{field} is empty: there is nothing to continue")
        ids: list[int] = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RequestError(field, f"{field} has no tokens")
        return ids

    def _fit(self, ids: list[int], max_tokens: int | None, field: str) -> int:
        """max_tokens that fits the context: the one asked for, or an error with the numbers;
        unasked, up to DEFAULT_OPENAI_TOKENS."""
        ctx = self.context_length
        if max_tokens is None:
            room = ctx - len(ids)
            if room < 1:
                raise RequestError(
                    field,
                    f"{field} has {len(ids)} tokens: no room to generate within the model's "
                    f"context length of {ctx} tokens",
                )
            return min(DEFAULT_OPENAI_TOKENS, room, self.max_tokens_limit)
        if len(ids) + max_tokens > ctx:
            raise RequestError(
                field,
                f"{field} has {len(ids)} tokens and max_tokens is {max_tokens}: "
                f"{len(ids) + max_tokens} tokens, beyond the model's context length of "
                f"{ctx} tokens",
            )
        return max_tokens

    async def _generate(self, prompts: Sequence[tuple[list[int], SamplingParams]]) -> list[str]:
        """Stripped greedy answers for V1/V2; a late request is RequestTimedOut (504)."""
        results = await self._engine.generate(prompts)
        if any(r.finish_reason == "timeout" for r in results):
            raise RequestTimedOut(self._timeout_message())
        return [r.text.strip() for r in results]

    def _timeout_message(self) -> str:
        return (
            f"the request did not finish within request_timeout_s="
            f"{self.options.request_timeout_s:g}s"
        )

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
            for i, inst in enumerate(instances):
                ids = self._encode(inst.prompt, f"instances[{i}].prompt")
                n = self._fit(ids, inst.max_new_tokens, f"instances[{i}].prompt")
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
            check_types(params, prefix="parameters.")
            asked = params.get("max_tokens", DEFAULT_NEW_TOKENS)
            if not 1 <= asked <= self.max_tokens_limit:
                raise RequestError(
                    "max_tokens",
                    f"parameters.max_tokens must be 1..{self.max_tokens_limit}, not {asked}",
                )
            for i, text in enumerate(texts):
                ids = self._encode(text, f"text_input[{i}]")
                max_tokens = self._fit(ids, asked, f"text_input[{i}]")
                prompts.append(
                    (
                        ids,
                        sampling_params(
                            max_tokens=max_tokens,
                            temperature=params.get("temperature"),
                            top_p=params.get("top_p"),
                            seed=params.get("seed"),
                            stop=params.get("stop"),
                            limit=self.max_tokens_limit,
                            prefix="parameters.",
                        ),
                    )
                )
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

    def apply_chat_template(self, request: ChatCompletionRequest) -> ChatPrompt:
        """The tokenizer's own chat template, with the assistant's turn opened."""
        messages = chat_messages(request.messages)
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
        return ChatPrompt(prompt=str(prompt))

    def _openai_params(
        self, request: CompletionRequest | ChatCompletionRequest, body: Mapping[str, Any]
    ) -> tuple[int | None, dict[str, Any]]:
        """max_tokens asked for (None: unasked) and the sampling fields, checked."""
        check_types(body)
        if request.n is not None and request.n != 1:
            raise RequestError("n", f"n must be 1 (one choice per prompt), not {request.n}")
        for name in ("logprobs", "echo", "suffix", "logit_bias", "tools"):
            if getattr(request, name, None) not in (None, False, [], {}):
                raise RequestError(name, f"{name} is not supported by this server")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(request, name, None) not in (None, 0, 0.0):
                raise RequestError(name, f"{name} is not supported by this server")
        newer = getattr(request, "max_completion_tokens", None)  # chat's name for max_tokens
        name = "max_tokens" if newer is None else "max_completion_tokens"
        # from __dict__: chat's max_tokens property warns that it is deprecated on each read
        asked: int | None = vars(request).get("max_tokens") if newer is None else newer
        if body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            asked = None  # pydantic filled in its default; ours depends on the prompt's length
        temperature = request.temperature
        top_p = request.top_p
        if temperature is None:  # unasked: what the model's generation config says
            gen = getattr(self.model, "generation_config", None)
            sample = bool(getattr(gen, "do_sample", False))
            temperature = float(getattr(gen, "temperature", None) or 1.0) if sample else 0.0
            if top_p is None and sample:
                top_p = getattr(gen, "top_p", None)
        if asked is not None and not 1 <= asked <= self.max_tokens_limit:
            raise RequestError(name, f"{name} must be 1..{self.max_tokens_limit}, not {asked}")
        return asked, {
            "temperature": temperature,
            "top_p": top_p,
            "seed": request.seed,
            "stop": request.stop,
        }

    def _openai_prompts(
        self, prompts: list[str], field: str, asked: int | None, fields: dict[str, Any]
    ) -> list[tuple[list[int], SamplingParams]]:
        out = []
        for i, prompt in enumerate(prompts):
            where = field if len(prompts) == 1 else f"{field}[{i}]"
            ids = self._encode(prompt, where)
            max_tokens = self._fit(ids, asked, where)
            out.append(
                (ids, sampling_params(max_tokens=max_tokens, limit=self.max_tokens_limit, **fields))
            )
        return out

    async def create_completion(
        self,
        request: CompletionRequest,
        raw_request: Any = None,
        context: dict[str, Any] | None = None,
    ) -> CompletionResult:
        try:
            body = await _raw_body(raw_request)
            asked, fields = self._openai_params(request, body)
            prompt = request.prompt
            if isinstance(prompt, str):
                prompts = [prompt]
            elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                prompts = list(prompt)
            else:
                raise RequestError(
                    "prompt", "prompt must be a string or a non-empty list of strings"
                )
            if len(prompts) > MAX_INSTANCES:
                raise RequestError("prompt", f"prompt must hold 1 to {MAX_INSTANCES} strings")
            encoded = self._openai_prompts(prompts, "prompt", asked, fields)
        except RequestError as err:
            return _error(err, err.status, err.field)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return await self._serve_openai(encoded, bool(request.stream), include_usage, chat=False)

    async def create_chat_completion(
        self,
        request: ChatCompletionRequest,
        raw_request: Any = None,
        context: dict[str, Any] | None = None,
    ) -> ChatResult:
        try:
            body = await _raw_body(raw_request)
            asked, fields = self._openai_params(request, body)
            prompt = self.apply_chat_template(request).prompt
            encoded = self._openai_prompts([prompt], "messages", asked, fields)
        except RequestError as err:
            return _error(err, err.status, err.field)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        result = await self._serve_openai(encoded, bool(request.stream), include_usage, chat=True)
        if isinstance(result, Completion):
            return self.completion_to_chat_completion(result, "assistant")
        return result

    async def _serve_openai(
        self,
        encoded: list[tuple[list[int], SamplingParams]],
        stream: bool,
        include_usage: bool,
        chat: bool,
    ) -> AsyncGenerator[str, None] | Completion | ErrorResponse:
        try:
            requests, events = self._engine.submit_async(encoded, stream=stream)
        except (QueueFull, EngineStopped) as err:
            return _error(str(err), HTTPStatus.SERVICE_UNAVAILABLE)
        if stream:
            return self._sse(requests, events, include_usage, chat)
        try:
            results = await _collect(requests, events)
        except EngineStopped as err:
            return _error(str(err), HTTPStatus.SERVICE_UNAVAILABLE)
        if any(r.finish_reason == "timeout" for r in results):
            return _error(self._timeout_message(), HTTPStatus.GATEWAY_TIMEOUT)
        return Completion(
            id=f"cmpl-{generate_uuid()}",
            created=int(time.time()),
            model=self.name,
            object="text_completion",
            choices=[
                CompletionChoice(index=i, text=r.text, finish_reason=_finish_reason(r))
                for i, r in enumerate(results)
            ],
            usage=_usage(results),
        )

    async def _sse(
        self,
        requests: list[GenerationRequest],
        events: Any,
        include_usage: bool,
        chat: bool,
    ) -> AsyncGenerator[str, None]:
        """Server-sent events: a chunk per decoded piece, a last chunk per choice with its
        finish_reason, the usage if asked, then [DONE]."""
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{generate_uuid()}"
        created = int(time.time())

        def chunk(index: int, text: str, finish: str | None) -> str:
            c = CompletionChunk(
                id=cid,
                created=created,
                model=self.name,
                object="text_completion",
                choices=[CompletionChunkChoice(index=index, text=text, finish_reason=finish)],
            )
            out = self.completion_to_chat_completion_chunk(c, "assistant") if chat else c
            return f"data: {out.model_dump_json(exclude_none=True)}\n\n"

        results: list[Generation] = []
        try:
            left = len(requests)
            while left:
                index, event = await events.get()
                if isinstance(event, TokenDelta):
                    yield chunk(index, event.text, None)
                elif isinstance(event, Generation):
                    results.append(event)
                    left -= 1
                    yield chunk(index, "", _finish_reason(event))
                elif isinstance(event, Failed):
                    error = _error(str(event.error), HTTPStatus.SERVICE_UNAVAILABLE)
                    yield f"data: {error.model_dump_json()}\n\n"
                    break
            if include_usage and len(results) == len(requests):
                kind = ChatCompletionChunk if chat else CompletionChunk
                usage = kind(id=cid, created=created, model=self.name, choices=[])
                usage.usage = _usage(results)
                yield f"data: {usage.model_dump_json(exclude_none=True)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for req in requests:
                req.cancel()  # the client went away: free its rows


async def _collect(requests: list[GenerationRequest], events: Any) -> list[Generation]:
    results: list[Generation | None] = [None] * len(requests)
    try:
        left = len(requests)
        while left:
            index, event = await events.get()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Generation):
                results[index] = event
                left -= 1
    finally:
        for req in requests:
            req.cancel()
    return [r for r in results if r is not None]


def _usage(results: Sequence[Generation]) -> UsageInfo:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(len(r.token_ids) for r in results)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


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
