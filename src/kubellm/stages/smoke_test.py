"""The smoke_test stage: real prompts to the served model; promote to champion or roll back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kubellm.backends.base import JobFailed
from kubellm.serve.client import Endpoint, ask
from kubellm.stages.context import StageContext, StageResult
from kubellm.tracking import CHAMPION

SMOKE_PROMPTS = 8
MIN_AGREEMENT = 0.9


@dataclass
class Result(StageResult):
    prompt: str = ""
    answer: str = ""
    expected: str = ""
    agreement: float = 0.0
    served_exact_match: float = 0.0


def run(ctx: StageContext, endpoint_url: str, predictions_path: str | Path, version: str) -> Result:
    """Real prompts to the served model: its answers must match what evaluate saw offline.

    On success the version becomes `champion`; on failure the deployment is rolled back
    (deleted) and the step fails with the reason.
    """
    cfg = ctx.cfg
    endpoint = Endpoint(cfg.model_name, endpoint_url)
    expected = json.loads(Path(predictions_path).read_text())[:SMOKE_PROMPTS]
    if not expected:
        raise JobFailed("evaluate recorded no held-out prompts to smoke-test with")
    with ctx.stage("smoke_test") as run_id:
        prompts = [e["prompt"] for e in expected]
        # same decoding budget as evaluate, so the answers are comparable token for token
        answers = ask(endpoint, prompts, int(expected[0].get("max_new_tokens", 8)))
        agree = sum(a == e["prediction"] for a, e in zip(answers, expected, strict=True))
        correct = sum(a == e["completion"] for a, e in zip(answers, expected, strict=True))
        result = Result(
            metrics={
                "agreement": agree / len(expected),
                "served_exact_match": correct / len(expected),
            },
            prompt=prompts[0],
            answer=answers[0],
            expected=expected[0]["completion"],
            agreement=agree / len(expected),
            served_exact_match=correct / len(expected),
        )
        ctx.tracker.log(
            run_id,
            metrics=result.metrics,
            params={"prompt": result.prompt, "answer": result.answer, "expected": result.expected},
        )
        if result.agreement < MIN_AGREEMENT:
            ctx.backends.server.delete(cfg.model_name, ctx.kfp_run_id)
            raise JobFailed(
                f"served answers match the evaluated model on {agree}/{len(expected)} prompts "
                f"(< {MIN_AGREEMENT:.0%}); rolled back {cfg.model_name}"
            )
        ctx.tracker.client.set_registered_model_alias(cfg.model_name, CHAMPION, version)
    result.report = (
        f"# Smoke test\n\n`{result.prompt}` -> `{result.answer}` (expected `{result.expected}`); "
        f"served = evaluated on {result.agreement:.0%} of prompts; version {version} is champion\n"
    )
    result.headline = (
        f"{result.prompt!r} -> {result.answer!r} (expected {result.expected!r}); "
        f"agreement {agree}/{len(expected)}; version {version} is champion"
    )
    return ctx.finish("smoke_test", result)
