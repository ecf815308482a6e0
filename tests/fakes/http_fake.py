"""The loopback HTTP server every fake API server runs on (a thread, a free port)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar


class JsonHandler(BaseHTTPRequestHandler):
    """Replies as a JSON API does; quiet, since the fakes record every request themselves."""

    def _read_json(self) -> Any:
        """The request body as JSON (None when empty); ValueError when it is not JSON."""
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else None

    def _send(self, code: int, body: Any) -> None:
        if isinstance(body, str):
            data, ctype = body.encode(), "text/plain"
        else:
            data, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the recorded requests are the log."""


class LoopbackFake:
    """Start/stop and URL for a fake whose request handler reads its state from `fake`."""

    handler: ClassVar[type[BaseHTTPRequestHandler]]
    thread_name: ClassVar[str] = "fake"

    def __init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        # http.server hands handlers only their server; a class per fake carries the state.
        handler = type("Handler", (self.handler,), {"fake": self})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.02},
            name=self.thread_name,
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None, f"{type(self).__name__} is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"
