"""Run the KServe ModelServer for one model directory: V1, V2 and OpenAI-compatible routes.

Locally it binds 127.0.0.1 (kserve's own server always binds 0.0.0.0); in a pod the
InferenceService passes `--host 0.0.0.0`. CPU-only, on the tiny model the tests build:

    python -m kubellm.serve runs/model --name kubellm-tiny --port 8080
    curl -s localhost:8080/openai/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "kubellm-tiny", "prompt": "12+7=", "max_tokens": 4, "temperature": 0}'

Requests from every route share one batching engine (kubellm.serve.engine); the options
below bound it: a full queue answers 503, a request past --request-timeout-s answers 504.
Before any work, a body over --max-body-bytes answers 413 and a prompt that cannot fit the
model's context 400 (kubellm.serve.model). The routes:

    GET  /health, /v2/health/ready, /v1/models/NAME        readiness (vLLM's, V2's, V1's)
    POST /openai/v1/completions, /openai/v1/chat/completions
    GET  /openai/v1/models, /openai/v1/models/NAME
    POST /v1/models/NAME:predict, /v2/models/NAME/infer     KServe V1, V2
    GET  /metrics                                          Prometheus

kserve's model repository routes (POST /v2/repository/models/NAME/load and /unload) are not
served: anyone who can reach the port could unload the model.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exception_handlers import (
    http_exception_handler,
    request_validation_exception_handler,
)
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from kserve import ModelServer
from kserve.logging import KSERVE_TRACE_LOGGER_NAME
from kserve.protocol.rest.server import RESTServer, metrics_handler
from kserve.protocol.rest.v1_endpoints import register_v1_endpoints
from kserve.protocol.rest.v2_endpoints import register_v2_endpoints
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kubellm.serve import protocol
from kubellm.serve.engine import EngineOptions, EngineStopped, QueueFull, RequestTimedOut
from kubellm.serve.model import CausalLMModel
from kubellm.serve.protocol import RequestError

DEFAULTS = EngineOptions()
OPENAI_PREFIX = "/openai/v1"
MAX_BODY_BYTES = 4 * 2**20  # the default --max-body-bytes: 4 MiB
R = TypeVar("R", bound=protocol.OpenAIRequest)

log = logging.getLogger(__name__)


async def _busy(_: Any, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=503, content={"error": str(exc)})


async def _timed_out(_: Any, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=504, content={"error": str(exc)})


def _speaks_openai(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX) or path == "/health"


def openai_error(status: int, message: str, param: str | None = None) -> Response:
    return Response(
        protocol.error_body(status, message, param).model_dump_json(),
        status_code=status,
        media_type="application/json",
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's own 404 (no route), 405 (wrong method), ...: OpenAI's shape on its routes."""
    assert isinstance(exc, StarletteHTTPException)
    if _speaks_openai(request.url.path):
        return openai_error(exc.status_code, str(exc.detail))
    return await http_exception_handler(request, exc)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    if _speaks_openai(request.url.path):
        first: dict[str, Any] = next(iter(exc.errors()), {})
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "path", "query")]
        return openai_error(
            422, f"{'.'.join(loc)}: {first.get('msg', 'invalid')}", loc[0] if loc else None
        )
    return await request_validation_exception_handler(request, exc)


# -- the request body limit -------------------------------------------------------------------


class BodyLimit:
    """Refuse a request body over `max_bytes` (413) before the app reads it: at once when its
    Content-Length says so, and while it arrives otherwise (chunked), so an oversized body is
    never held in memory. OpenAI's error shape on the OpenAI routes, kserve's elsewhere."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await self._refuse(scope, send, 400, "Content-Length is not a number")
            elif int(length) > self.max_bytes:
                await self._refuse(scope, send, 413, f"the request body is {int(length)} bytes")
            else:  # the HTTP parser holds the body to its Content-Length
                await self.app(scope, receive, send)
            return
        # no Content-Length (chunked, or no body): read it here, counting, then replay it
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, send, 413, f"the request body is over {size} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, status: int, why: str) -> None:
        message = f"{why}: this server takes at most {self.max_bytes} (--max-body-bytes)"
        if status != 413:
            message = why
        if _speaks_openai(scope["path"]):
            body = protocol.error_body(status, message).model_dump_json().encode()
        else:
            body = bytes(JSONResponse(content={"error": message}).body)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# -- the OpenAI routes ------------------------------------------------------------------------


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; None if the client disconnects first: a watch task then cancels this
    task, so `work` (the engine's rows) is cancelled and a request nobody waits for stops
    decoding. `work` runs in the caller's task, not a task of its own: its result needs no
    extra turns of the event loop to reach the response."""
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (the server stopping): not ours to swallow
        current.uncancel()
        return None
    finally:
        watcher.cancel()


def openai_routes(models: Mapping[str, CausalLMModel]) -> list[Route]:
    """/openai/v1/completions, /chat/completions, /models, /models/{id} for `models`.

    Plain Starlette routes, not FastAPI's: each handler reads and checks its own body
    (protocol.parse_request), so FastAPI's per-request dependency solving and response
    validation would be work for nothing (docs/benchmarks-serve.md)."""

    async def call(
        request: Request,
        kind: type[R],
        handle: Callable[[CausalLMModel, R], Awaitable[Any]],
    ) -> Response:
        try:
            parsed = protocol.parse_request(kind, await request.body())
        except RequestError as err:
            return openai_error(err.status, str(err), err.field)
        model = models.get(parsed.model)
        if model is None:
            return openai_error(
                404,
                f"the model `{parsed.model}` does not exist: this server serves "
                f"{', '.join(f'`{m}`' for m in models)}",
                "model",
            )
        if not model.ready:
            return openai_error(503, f"the model `{parsed.model}` is not ready")
        try:
            result = await _unless_disconnected(request, handle(model, parsed))
        except RequestError as err:
            return openai_error(err.status, str(err), err.field)
        except (QueueFull, EngineStopped) as err:
            return openai_error(503, str(err))
        except RequestTimedOut as err:
            return openai_error(504, str(err))
        except Exception as err:
            log.exception("%s failed", request.url.path)
            return openai_error(500, f"{type(err).__name__}: {err}")
        if result is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        if isinstance(result, BaseModel):
            return Response(result.model_dump_json(), media_type="application/json")
        return StreamingResponse(result, media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await call(request, protocol.CompletionRequest, CausalLMModel.create_completion)

    async def chat_completions(request: Request) -> Response:
        return await call(
            request, protocol.ChatCompletionRequest, CausalLMModel.create_chat_completion
        )

    async def list_models(_: Request) -> Response:
        cards = [m.card() for m in models.values() if m.ready]
        body = protocol.ModelList(data=cards)
        return Response(body.model_dump_json(), media_type="application/json")

    async def retrieve_model(request: Request) -> Response:
        model_id = request.path_params["model_id"]
        model = models.get(model_id)
        if model is None:
            return openai_error(404, f"the model `{model_id}` does not exist", "model")
        return Response(model.card().model_dump_json(), media_type="application/json")

    return [
        Route(f"{OPENAI_PREFIX}/completions", completions, methods=["POST"]),
        Route(f"{OPENAI_PREFIX}/chat/completions", chat_completions, methods=["POST"]),
        Route(f"{OPENAI_PREFIX}/models", list_models, methods=["GET"]),
        Route(f"{OPENAI_PREFIX}/models/{{model_id:path}}", retrieve_model, methods=["GET"]),
    ]


class OpenAIFirst:
    """The app uvicorn serves: a POST to an OpenAI route goes straight to its handler (inside
    the body limit), everything else through `app`, the FastAPI app with kserve's routes.

    The handlers answer every error themselves (`call` above), so FastAPI's and Starlette's
    middleware stack (error, telemetry, exception and exit-stack layers, then the router's
    matching) does nothing for them but run: on a request of a few ms it was about a tenth
    of the event loop's time per request (docs/benchmarks-serve.md). The routes stay in `app`
    as well, where a test client or the router finds them."""

    def __init__(self, app: ASGIApp, routes: list[Route], max_bytes: int) -> None:
        self.app = app
        self.direct = {
            r.path: BodyLimit(r.app, max_bytes) for r in routes if "POST" in (r.methods or ())
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.direct.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the server -------------------------------------------------------------------------------


class _Routers:
    """Stands in for the app in kserve's register_*_endpoints: keeps the routers they make,
    so routes can be left out before they are served."""

    def __init__(self) -> None:
        self.routers: list[APIRouter] = []

    def include_router(self, router: APIRouter, **_: Any) -> None:
        self.routers.append(router)


class _RESTServer(RESTServer):  # type: ignore[misc]
    """kserve's REST server on an app of its own (not kserve's module-global one), with:

    - kserve's V1 and V2 routes, without the model repository's load and unload routes
      (anyone who can reach the port could unload the model);
    - our OpenAI-compatible routes (kubellm.serve.protocol) instead of kserve's, which take
      their types from vllm, and vLLM's `/health`;
    - the request body limit (`max_body_bytes`, 413);
    - without `latency_log`, without kserve's timing middleware, which times every request
      only to log it (kserve.trace): on a request of a few milliseconds its share is
      measurable (docs/benchmarks-serve.md)."""

    latency_log = False
    max_body_bytes = MAX_BODY_BYTES
    app: FastAPI | None = None
    openai: list[Route] = []  # noqa: RUF012  (set per instance by _register_endpoints)

    def _models(self) -> dict[str, CausalLMModel]:
        return {
            name: model
            for name, model in self.dataplane.model_registry.get_models().items()
            if isinstance(model, CausalLMModel)
        }

    def _add_middlewares(self, app: FastAPI) -> None:
        if self.latency_log:
            super()._add_middlewares(app)
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)  # outermost: first

    def _register_endpoints(self, app: FastAPI) -> None:
        models = self._models()

        async def health() -> Response:
            """vLLM's: 200 once every model is ready."""
            waiting = [name for name, m in models.items() if not m.ready]
            if waiting:
                return openai_error(503, f"not ready: {', '.join(waiting)}")
            return Response(status_code=200)

        root = APIRouter()
        root.add_api_route("/", self.dataplane.live, methods=["GET"])
        root.add_api_route("/metrics", metrics_handler, methods=["GET"])
        root.add_api_route("/health", health, methods=["GET"], response_model=None)
        app.include_router(root)
        kserve_routes = _Routers()
        register_v1_endpoints(kserve_routes, self.dataplane, None)
        register_v2_endpoints(kserve_routes, self.dataplane, None)
        for router in kserve_routes.routers:
            router.routes[:] = [
                r for r in router.routes if "/repository/" not in getattr(r, "path", "")
            ]
            app.include_router(router)
        self.openai = openai_routes(models)
        app.router.routes[:0] = self.openai  # first: the routes most requests take

    def _add_exception_handlers(self, app: FastAPI) -> None:
        super()._add_exception_handlers(app)
        # V1 and V2 raise these from the model; kserve's handlers would make them 500s
        app.add_exception_handler(QueueFull, _busy)
        app.add_exception_handler(EngineStopped, _busy)
        app.add_exception_handler(RequestTimedOut, _timed_out)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(RequestValidationError, _validation_error)

    def create_application(self) -> FastAPI:
        app = FastAPI(title="kubellm model server", docs_url=None, redoc_url=None)
        self._add_middlewares(app)
        self._register_endpoints(app)
        self._add_exception_handlers(app)
        self.app = app
        # uvicorn takes the app itself as well as an import string; with latency_log, kserve's
        # timing middleware times the OpenAI routes too, so they go through the app
        served = app if self.latency_log else OpenAIFirst(app, self.openai, self.max_body_bytes)
        self.config.app = served
        return app


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (kserve's and uvicorn's "auto"), else asyncio's.

    kserve's ModelServer with one worker runs `asyncio.run` itself, so uvicorn never picks
    the loop and kserve's `event_loop` option ("auto": uvloop if available) has no effect:
    the server ran on asyncio's selector loop. uvloop's is the one uvicorn would choose."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


class BoundModelServer(ModelServer):  # type: ignore[misc]
    """kserve.ModelServer with the REST host chosen by us, and no gRPC port."""

    def __init__(
        self,
        host: str,
        http_port: int,
        latency_log: bool = False,
        max_body_bytes: int = MAX_BODY_BYTES,
        access_log: bool = True,
    ) -> None:
        super().__init__(http_port=http_port, enable_grpc=False, workers=1)
        self.host = host
        self.latency_log = latency_log
        self.max_body_bytes = max_body_bytes
        self.access_log = access_log

    def rest_server(self, models: list[CausalLMModel]) -> _RESTServer:
        """Register `models` and build the REST server (`create_application()` makes its
        app; `start()` makes it and serves it)."""
        self._register_and_check_atleast_one_model_is_ready(models)
        rest = _RESTServer(
            "kserve.model_server:app",  # replaced by create_application
            self.dataplane,
            self.model_repository_extension,
            self.http_port,
            workers=1,
            grace_period=self.grace_period,
            event_loop=self.event_loop,
            timeout_keep_alive=self.timeout_keep_alive,
        )
        rest.config.host = self.host
        rest.latency_log = self.latency_log
        rest.max_body_bytes = self.max_body_bytes
        if not self.access_log:
            # kserve builds the Config (log_config=None, no log_level) before this flag is
            # known; configuring its logging again then only leaves uvicorn's access logger
            # without handlers, and uvicorn logs a request only while it has one
            rest.config.access_log = False
            rest.config.configure_logging()
        return rest

    def start(self, models: list[CausalLMModel]) -> None:
        self._rest_server = self.rest_server(models)
        self.servers.append(self._rest_server.start())
        self.register_signal_handler()
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            # kserve's setup_event_loop configures asyncio.get_event_loop(), which is not
            # the loop asyncio.run then makes: here it is the loop that serves
            runner.run(self._setup_and_serve())

    async def _setup_and_serve(self) -> None:
        self.setup_event_loop()
        loop = type(asyncio.get_running_loop())
        log.info("event loop: %s.%s", loop.__module__, loop.__qualname__)
        await self._serve()


def _positive(kind: type, allow_zero: bool = False) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be > {'= ' if allow_zero else ''}0: {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kubellm serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_dir", help="Hugging Face model directory (config.json, safetensors)")
    p.add_argument("--name", default="kubellm", help="model name in the URL (/v1/models/NAME)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model's own Python code (off by default)",
    )
    p.add_argument(
        "--max-batch",
        type=_positive(int),
        default=DEFAULTS.max_batch,
        help="most requests decoded together (default %(default)s)",
    )
    p.add_argument(
        "--max-wait-ms",
        type=_positive(float, allow_zero=True),
        default=DEFAULTS.max_wait_ms,
        help="under load, how long a batch waits to fill; a lone request never waits "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-queue",
        type=_positive(int),
        default=DEFAULTS.max_queue,
        help="requests waiting for a batch; beyond it requests get 503 (default %(default)s)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=_positive(float),
        default=DEFAULTS.request_timeout_s,
        help="a request still running after this gets 504, a stream ends (default %(default)s)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=_positive(int),
        default=None,
        help="most new tokens one request may ask for, on top of the model's context (a "
        "prompt plus its max_tokens must fit in it); it also caps chat's default, the rest of "
        "the context. Default: no cap but the context (--request-timeout-s still bounds a "
        "request)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=MAX_BODY_BYTES,
        help="largest request body; a larger one gets 413 before it is read (default "
        "%(default)s, 4 MiB)",
    )
    p.add_argument(
        "--latency-log",
        action="store_true",
        help="log kserve's per-request latency lines (kserve.trace); off by default",
    )
    p.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no access-log line per request (uvicorn.access; vLLM's "
        "--disable-uvicorn-access-log): on a request of a few ms its share of the event "
        "loop is measurable (docs/benchmarks.md). On by default",
    )
    return p


def serve(
    model_dir: str,
    name: str,
    host: str,
    port: int,
    trust_remote_code: bool = False,
    *,
    options: EngineOptions | None = None,
    max_tokens_limit: int | None = None,
    latency_log: bool = False,
    max_body_bytes: int = MAX_BODY_BYTES,
    access_log: bool = True,
) -> None:
    logging.basicConfig(level=logging.INFO)
    if not latency_log:
        # kserve's timing middleware logs two lines per request (kserve.trace); on a request
        # of a few ms that logging is a measurable share. The access log stays.
        logging.getLogger(KSERVE_TRACE_LOGGER_NAME).setLevel(logging.WARNING)
    model = CausalLMModel(
        name,
        model_dir,
        trust_remote_code=trust_remote_code,
        options=options,
        max_tokens_limit=max_tokens_limit,
    )
    model.load()
    # The imports and the model leave ~10^6 long-lived objects; a full collection walking them
    # stalls every request in flight for hundreds of ms. Frozen, collections skip them.
    gc.collect()
    gc.freeze()
    print(f"serving {name} from {model_dir} on http://{host}:{port}", flush=True)
    BoundModelServer(
        host=host,
        http_port=port,
        latency_log=latency_log,
        max_body_bytes=max_body_bytes,
        access_log=access_log,
    ).start([model])


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    options = EngineOptions(
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout_s,
    )
    serve(
        args.model_dir,
        args.name,
        args.host,
        args.port,
        args.trust_remote_code,
        options=options,
        max_tokens_limit=args.max_tokens_limit,
        latency_log=args.latency_log,
        max_body_bytes=args.max_body_bytes,
        access_log=args.access_log,
    )
