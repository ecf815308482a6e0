"""The KServe model: a Hugging Face causal LM behind the V1 predict protocol.

Request  {"instances": [{"prompt": "12+7=", "max_new_tokens": 8}, "3+4=", ...]}
Response {"predictions": ["19", "7", ...]}
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import kserve
from kserve.errors import InvalidInput

from kubellm.serve.generate import complete, load_model

MAX_NEW_TOKENS = 256
DEFAULT_NEW_TOKENS = 8
MAX_INSTANCES = 256


class CausalLMModel(kserve.Model):  # type: ignore[misc]
    def __init__(self, name: str, model_dir: str | Path, trust_remote_code: bool = False) -> None:
        super().__init__(name)
        self.model_dir = Path(model_dir)
        self.trust_remote_code = trust_remote_code
        self.model: Any = None
        self.tokenizer: Any = None
        self.ready = False

    def load(self) -> bool:
        self.model, self.tokenizer = load_model(self.model_dir, self.trust_remote_code)
        self.ready = True
        return True

    async def predict(
        self,
        payload: Any,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        prompts, max_new = parse_instances(payload)
        # generation is CPU-bound: keep the event loop free for health checks
        answers = await asyncio.get_running_loop().run_in_executor(
            None, complete, self.model, self.tokenizer, prompts, max_new
        )
        return {"predictions": answers}


def parse_instances(payload: Any) -> tuple[list[str], int]:
    """Prompts and one max_new_tokens from a V1 payload; a bad payload is a 400 naming why."""
    if not isinstance(payload, dict) or not isinstance(payload.get("instances"), list):
        raise InvalidInput('expected a JSON object with an "instances" list')
    instances = payload["instances"]
    if not instances or len(instances) > MAX_INSTANCES:
        raise InvalidInput(f'"instances" must hold 1 to {MAX_INSTANCES} items')
    prompts: list[str] = []
    max_new = 0  # one batch, one length: the largest any instance asks for
    for i, inst in enumerate(instances):
        if isinstance(inst, str):
            prompts.append(inst)
            max_new = max(max_new, DEFAULT_NEW_TOKENS)
            continue
        if not isinstance(inst, dict) or not isinstance(inst.get("prompt"), str):
            raise InvalidInput(f'instances[{i}] must be a string or have a string "prompt"')
        prompts.append(inst["prompt"])
        value = inst.get("max_new_tokens", DEFAULT_NEW_TOKENS)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= MAX_NEW_TOKENS
        ):
            raise InvalidInput(f"instances[{i}].max_new_tokens must be 1..{MAX_NEW_TOKENS}")
        max_new = max(max_new, value)
    return prompts, max_new
