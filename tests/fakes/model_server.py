"""A tiny model server speaking KServe's V1 protocol, for the simulated cluster's tests.

A FAKE, for tests only: it stands in for a serving image. It serves

    GET  /v1/models/<name>          200 {"name": ..., "ready": true}  (the readiness route)
    POST /v1/models/<name>:predict  200 {"predictions": <the request's instances>}

and reads the model directory it is given, so a wrong /mnt/models substitution shows:

    python tests/fakes/model_server.py /mnt/models --name m --host 0.0.0.0 --port 8080
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    config = Path(args.model_dir) / "config.json"
    if not config.is_file():
        print(f"no config.json in {args.model_dir}", file=sys.stderr, flush=True)
        return 3
    model = json.loads(config.read_text())

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == f"/v1/models/{args.name}":
                self._reply(200, {"name": args.name, "ready": True, "model": model})
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path == f"/v1/models/{args.name}:predict":
                self._reply(200, {"predictions": body.get("instances", [])})
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def log_message(self, format: str, *a: Any) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"serving {args.name} from {args.model_dir} on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
