"""Run the KServe ModelServer for one model directory.

Locally it binds 127.0.0.1 (kserve's own server always binds 0.0.0.0); in a pod the
InferenceService passes `--host 0.0.0.0`.

    python -m kubellm.serve runs/model --name kubellm-tiny --port 8080
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from kserve import ModelServer
from kserve.protocol.rest.server import RESTServer

from kubellm.serve.model import CausalLMModel


class BoundModelServer(ModelServer):  # type: ignore[misc]
    """kserve.ModelServer with the REST host chosen by us, and no gRPC port."""

    def __init__(self, host: str, http_port: int) -> None:
        super().__init__(http_port=http_port, enable_grpc=False, workers=1)
        self.host = host

    def start(self, models: list[CausalLMModel]) -> None:
        self._register_and_check_atleast_one_model_is_ready(models)
        self._rest_server = RESTServer(
            "kserve.model_server:app",
            self.dataplane,
            self.model_repository_extension,
            self.http_port,
            workers=1,
            grace_period=self.grace_period,
            event_loop=self.event_loop,
            timeout_keep_alive=self.timeout_keep_alive,
        )
        self._rest_server.config.host = self.host
        self.servers.append(self._rest_server.start())
        self.setup_event_loop()
        self.register_signal_handler()
        asyncio.run(self._serve())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubellm serve", description=__doc__)
    p.add_argument("model_dir", help="Hugging Face model directory (config.json, safetensors)")
    p.add_argument("--name", default="kubellm", help="model name in the URL (/v1/models/NAME)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model's own Python code (off by default)",
    )
    return p


def serve(model_dir: str, name: str, host: str, port: int, trust_remote_code: bool) -> None:
    logging.basicConfig(level=logging.INFO)
    model = CausalLMModel(name, model_dir, trust_remote_code=trust_remote_code)
    model.load()
    print(f"serving {name} from {model_dir} on http://{host}:{port}", flush=True)
    BoundModelServer(host=host, http_port=port).start([model])


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    serve(args.model_dir, args.name, args.host, args.port, args.trust_remote_code)
