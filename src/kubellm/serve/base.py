"""The server seam: serve a model directory behind the KServe V1 protocol, wait until ready.

Protocol (local ModelServer and InferenceService alike):
POST {url}/v1/models/{name}:predict  {"instances": [{"prompt": "...", "max_new_tokens": 8}]}
-> {"predictions": ["completion text", ...]}
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ServeRequest:
    name: str  # model / InferenceService name (DNS-1123)
    model_uri: str  # local directory (local) or storage URI / pvc:// path (cluster)
    namespace: str = "default"
    image: str = ""
    timeout_s: float = 600.0
    run_tag: str = ""  # the pipeline run that owns the server (for cleanup)


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str  # base URL; predict is {url}/v1/models/{name}:predict

    @property
    def predict_url(self) -> str:
        return f"{self.url.rstrip('/')}/v1/models/{self.name}:predict"


class Server(ABC):
    @abstractmethod
    def deploy(self, request: ServeRequest) -> Endpoint:
        """Start serving and return once the model answers readiness checks."""

    @abstractmethod
    def delete(self, name: str, run_tag: str = "") -> None:
        """Stop serving `name` (idempotent)."""

    def release(self, run_tag: str) -> int:
        """End of a pipeline run: stop what only lived for the run; returns how many.

        A cluster deployment outlives its run (it is the product), so by default nothing.
        """
        return 0
