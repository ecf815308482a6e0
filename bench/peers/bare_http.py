"""A bare HTTP server on the model server's own engine: the floor for its HTTP overhead.

Nothing but what every OpenAI completions request over HTTP has to do: uvloop's event loop
(the server's), httptools parsing the request (what uvicorn parses with), `json.loads` of
the body, the prompt encoded by the fast tokenizer's own `tokenizers.Tokenizer` (as
kubellm.serve.model encodes it), `BatchEngine.submit_async` and one await of its result,
the answer as JSON in the OpenAI completions shape (about the real server's bytes to
build and parse), written with its headers in one write. No framework (ASGI, Starlette,
FastAPI, kserve), no validation, no limits, no metrics, no access log, no disconnect
watch: a server nobody should run, and the lowest latency any Python server around this
engine can reach. `bench.serve_bench` measures it in the same turns as the real server
(information, no target): the real server's gap to the in-process engine, minus this
one's, is what the framework and our handler cost; this one's own gap is HTTP in Python
on this machine.

Same model directory, the same `EngineOptions` the server's flags give
(`bench.serve_bench.engine_options` of max_batch and max_wait_ms), the same torch threads
(OMP_NUM_THREADS from the bench). It answers `GET /v1/models/NAME` with `{"ready": true}`
(the bench's readiness poll) and `POST /openai/v1/completions` with `{"prompt",
"max_tokens"}` (greedy); anything else 404.

    python -m bench.peers.bare_http MODEL_DIR --port 8081 --name bench --max-batch 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import httptools

COMPLETIONS = b"/openai/v1/completions"


def response(status: int, body: bytes, keep_alive: bool) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Error"}[status]
    connection = b"" if keep_alive else b"connection: close\r\n"
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        reason,
        len(body),
        connection,
        body,
    )


class BareServer:
    """The engine and the tokenizer every connection shares."""

    def __init__(self, model_dir: str, name: str, max_batch: int, max_wait_ms: float | None):
        from bench.serve_bench import engine_options
        from kubellm.serve.engine import BatchEngine
        from kubellm.serve.generate import load_model

        model, tokenizer = load_model(model_dir)
        self.name = name
        self.backend = tokenizer.backend_tokenizer
        self.engine = BatchEngine(model, tokenizer, engine_options(max_batch, max_wait_ms))
        self.engine.start()

    async def complete(self, body: bytes) -> tuple[int, bytes]:
        from kubellm.serve.engine import Failed, Generation, SamplingParams

        req = json.loads(body)
        ids = self.backend.encode(req["prompt"], add_special_tokens=False).ids
        _, events = self.engine.submit_async([(ids, SamplingParams(max_tokens=req["max_tokens"]))])
        while True:
            _, event = await events.get()
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Generation):
                break
        answer = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.get("model", self.name),
            "choices": [{"index": 0, "text": event.text, "finish_reason": event.finish_reason}],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(event.token_ids),
                "total_tokens": len(ids) + len(event.token_ids),
            },
        }
        return 200, json.dumps(answer).encode()


class Connection(asyncio.Protocol):
    """One client connection: requests parsed by httptools, answered in order."""

    def __init__(self, server: BareServer) -> None:
        self.server = server
        self.ready = f"/v1/models/{server.name}".encode()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.queue: asyncio.Queue[tuple[bytes, bytes, bytes, bool]] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.worker = asyncio.get_running_loop().create_task(self.answer())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker is not None:
            self.worker.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(response(400, b'{"error": "bad request"}', False))
            self.transport.close()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, keep = self.parser.get_method(), self.parser.should_keep_alive()
        self.queue.put_nowait((method, self.url, b"".join(self.body), keep))

    async def answer(self) -> None:
        """Requests in the order they came (HTTP/1.1 pipelining keeps that order)."""
        assert self.transport is not None
        while True:
            method, url, body, keep = await self.queue.get()
            if method == b"POST" and url == COMPLETIONS:
                try:
                    status, out = await self.server.complete(body)
                except Exception as err:  # answered, so the bench shows it instead of hanging
                    status, out = (
                        500,
                        json.dumps({"error": f"{type(err).__name__}: {err}"}).encode(),
                    )
            elif method == b"GET" and url == self.ready:
                status, out = 200, b'{"ready": true}'
            else:
                status, out = 404, b'{"error": "not found"}'
            self.transport.write(response(status, out, keep))
            if not keep:
                self.transport.close()
                return


async def serve(args: argparse.Namespace) -> None:
    server = BareServer(args.model_dir, args.name, args.max_batch, args.max_wait_ms)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: Connection(server), args.host, args.port)
    print(f"bare_http: serving {args.model_dir} on {args.host}:{args.port}", flush=True)
    try:
        await listener.serve_forever()
    finally:
        server.engine.stop()


def main(argv: list[str] | None = None) -> None:
    import signal

    import uvloop

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="bench")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-wait-ms", type=float)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the bench stops it so
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args))


if __name__ == "__main__":
    main()
