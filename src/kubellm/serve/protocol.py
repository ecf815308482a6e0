"""The OpenAI-compatible API's shapes and field rules, in one place.

Requests: `parse_request(CompletionRequest, body)` (or ChatCompletionRequest) turns a JSON
body into a checked request, or raises RequestError naming the field. The rules:

- Types are strict, as the API states them: no "5" for 5, no 5.0 or true for an integer;
  null is "unset".
- A field we implement is declared on the model below. Fields that change nothing about the
  answer (`user`, `metadata`, ...: IGNORED) are accepted and dropped.
- A field we do not implement is refused (400 naming it) unless it holds its default value
  (UNSUPPORTED: `n` 1, `presence_penalty` 0, `response_format` {"type": "text"}, ...), so a
  load tool that asks for `repetition_penalty: 1.1` learns it did not get it rather than
  measuring something else. An unknown field is refused too, as OpenAI does.
- vLLM's extension fields `top_k`, `min_tokens` and `ignore_eos` are implemented, with
  vLLM's meanings.

Responses: the pydantic models below, in OpenAI's shapes (completions' legacy `logprobs`
{tokens, token_logprobs, top_logprobs, text_offset}, chat's `logprobs.content`). Errors:
`error_body`, OpenAI's {"error": {"message", "type", "param", "code"}} for every status.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_PROMPTS = 256  # prompts in one request (a list prompt)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI: 5 for completions, 20 for chat; vLLM 20)


class RequestError(ValueError):
    """A bad request: `field` names what is wrong, the message says how."""

    def __init__(self, field: str, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.field = field
        self.status = status


# -- errors -----------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """OpenAI's error object; `param` is the top-level field ("prompt[1]" -> "prompt")."""
    if param:
        param = param.split("[")[0].split(".")[0]
    kind = ERROR_TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")
    return ErrorResponse(
        error=ErrorInfo(message=message, type=kind, param=param or None, code=status)
    )


# -- requests ---------------------------------------------------------------------------------

NonNegative = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what torch.Generator takes
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]

# accepted and dropped: they ask for nothing a completion's text depends on
IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
    | {"request_id", "parallel_tool_calls"}
)

# not implemented: accepted only at these values (null always means unset)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "min_p": (0,),
    "logit_bias": ({},),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "priority": (0,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "documents": (),
    "mm_processor_kwargs": (),
}

# the wording of a type error for fields whose pydantic message would mislead (unions)
EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "messages": "a list of messages",
}


def _is_default(value: Any, accepted: tuple[Any, ...]) -> bool:
    # true == 1 in Python; here a bool is only ever the default of a bool
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted)


def _show(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class OpenAIRequest(BaseModel):
    """The fields completions and chat share; limits that need the model (the context
    length) are checked by the model."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: NonNegative | None = None  # None: the endpoint's default
    max_completion_tokens: NonNegative | None = None  # chat's newer name; wins when both
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # None: the model's
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM: 0 or -1 is off
    min_tokens: NonNegative = 0  # vLLM: no EOS or stop string before this many tokens
    ignore_eos: bool = False  # vLLM: EOS does not end the request
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def asked_tokens(self) -> tuple[str, int | None]:
        """(the field's name, max tokens asked for or None)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self) -> None:
        if len(self.stops) > MAX_STOP or any(s == "" for s in self.stops):
            raise RequestError("stop", f"stop must be up to {MAX_STOP} non-empty strings")
        name, asked = self.asked_tokens
        if asked == 0 and not self._scores_prompt:
            raise RequestError(
                name,
                f"{name} must be at least 1 (0 only with echo: the prompt scored, nothing new)",
            )
        if asked is not None and self.min_tokens > asked:
            raise RequestError(
                "min_tokens", f"min_tokens ({self.min_tokens}) is more than {name} ({asked})"
            )

    @property
    def _scores_prompt(self) -> bool:
        return False


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt first: in the text, and in logprobs
    logprobs: Logprobs | None = None  # k: each token's logprob and the k most likely

    @property
    def _scores_prompt(self) -> bool:
        return self.echo

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts: strings, or token-id lists (a list of ints is one prompt)."""
        p: Any = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # a list of ints: one prompt of token ids
        return list(p)  # strings, or lists of token ids

    def check(self) -> None:
        super().check()
        prompts = self.prompts
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise RequestError("prompt", f"prompt must hold 1 to {MAX_PROMPTS} prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise RequestError("prompt", f"{where} is empty: there is nothing to continue")
        if self.stream and self.logprobs is not None:
            raise RequestError("logprobs", "logprobs is not supported with stream: true")


class ChatCompletionRequest(OpenAIRequest):
    messages: list[Any]
    logprobs: bool = False
    top_logprobs: Logprobs | None = None  # needs logprobs: true

    def check(self) -> None:
        super().check()
        chat_messages(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.stream and self.logprobs:
            raise RequestError("logprobs", "logprobs is not supported with stream: true")


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


R = TypeVar("R", bound=OpenAIRequest)


def parse_request(kind: type[R], raw: bytes) -> R:
    """A checked request from a JSON body; RequestError naming the field otherwise."""
    try:
        body = json.loads(raw)
    except ValueError as err:  # UnicodeDecodeError is one
        raise RequestError("", f"the request body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise RequestError("", "the request body must be a JSON object")
    api = "chat completions" if kind is ChatCompletionRequest else "completions"
    fields = {}
    for name, value in body.items():
        if value is None or name in IGNORED:
            continue
        if name in UNSUPPORTED and name not in kind.model_fields:
            if not _is_default(value, UNSUPPORTED[name]):
                raise RequestError(name, f"{name}={_show(value)} is not supported by this server")
            continue
        if name not in kind.model_fields:
            raise RequestError(name, f"{name} is not a field of the {api} API")
        fields[name] = value
    try:
        request = kind.model_validate(fields)
    except ValidationError as err:
        raise _request_error(err) from None
    request.check()
    return request


def _request_error(err: ValidationError) -> RequestError:
    first = err.errors(include_url=False)[0]
    loc = [str(x) for x in first["loc"]]
    name = loc[0] if loc else ""
    if name in EXPECTED:
        return RequestError(name, f"{name} must be {EXPECTED[name]}")
    where = ".".join(loc)
    return RequestError(name, f"{where}: {first['msg']}, not {_show(first.get('input'))}")


# -- responses --------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: one entry per token (with echo, the prompt's first;
    the first prompt token has no logprob). `top_logprobs` maps each token string to its
    logprob: the k most likely and the token itself, so up to k + 1 entries, as OpenAI."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kubellm"
    max_model_len: int | None = None  # vLLM's field: the context length


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
