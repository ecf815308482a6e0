"""Run the KServe ModelServer for one model directory: V1, V2 and OpenAI-compatible routes.

Locally it binds 127.0.0.1 (kserve's own server always binds 0.0.0.0); in a pod the
InferenceService passes `--host 0.0.0.0`. CPU-only, on the tiny model the tests build:

    python -m kubellm.serve runs/model --name kubellm-tiny --port 8080
    curl -s localhost:8080/openai/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "kubellm-tiny", "prompt": "12+7=", "max_tokens": 4, "temperature": 0}'

Requests from every route share one batching engine (kubellm.serve.engine); the options
below bound it: a full queue answers 503, a request past --request-timeout-s answers 504.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from typing import Any

from fastapi.responses import JSONResponse
from kserve import ModelServer
from kserve.logging import KSERVE_TRACE_LOGGER_NAME
from kserve.protocol.rest.server import RESTServer

from kubellm.serve.engine import EngineOptions, EngineStopped, QueueFull, RequestTimedOut
from kubellm.serve.model import MAX_NEW_TOKENS, CausalLMModel

DEFAULTS = EngineOptions()


async def _busy(_: Any, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=503, content={"error": str(exc)})


async def _timed_out(_: Any, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=504, content={"error": str(exc)})


class _RESTServer(RESTServer):  # type: ignore[misc]
    """kserve's REST server; without `latency_log`, without its timing middleware, which
    times every request only to log it (kserve.trace): on a request of a few milliseconds
    its share is measurable (docs/benchmarks-serve.md)."""

    latency_log = False

    def _add_middlewares(self, app: Any) -> None:
        if self.latency_log:
            super()._add_middlewares(app)
            return
        from timing_asgi import TimingMiddleware

        super()._add_middlewares(app)
        app.user_middleware = [m for m in app.user_middleware if m.cls is not TimingMiddleware]


class BoundModelServer(ModelServer):  # type: ignore[misc]
    """kserve.ModelServer with the REST host chosen by us, and no gRPC port."""

    def __init__(self, host: str, http_port: int, latency_log: bool = False) -> None:
        super().__init__(http_port=http_port, enable_grpc=False, workers=1)
        self.host = host
        self.latency_log = latency_log

    def rest_server(self, models: list[CausalLMModel]) -> RESTServer:
        """Register `models` and build the REST server (its app is kserve's global one)."""
        from kserve.model_server import app

        # V1 and V2 raise these from the model; kserve's handlers would make them 500s
        app.add_exception_handler(QueueFull, _busy)
        app.add_exception_handler(EngineStopped, _busy)
        app.add_exception_handler(RequestTimedOut, _timed_out)
        self._register_and_check_atleast_one_model_is_ready(models)
        rest = _RESTServer(
            "kserve.model_server:app",
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
        return rest

    def start(self, models: list[CausalLMModel]) -> None:
        self._rest_server = self.rest_server(models)
        self.servers.append(self._rest_server.start())
        self.setup_event_loop()
        self.register_signal_handler()
        asyncio.run(self._serve())


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
        default=MAX_NEW_TOKENS,
        help="most new tokens one request may ask for (default %(default)s)",
    )
    p.add_argument(
        "--latency-log",
        action="store_true",
        help="log kserve's per-request latency lines (kserve.trace); off by default",
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
    max_tokens_limit: int = MAX_NEW_TOKENS,
    latency_log: bool = False,
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
    BoundModelServer(host=host, http_port=port, latency_log=latency_log).start([model])


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
    )
