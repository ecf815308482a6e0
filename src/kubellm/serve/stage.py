"""deploy and smoke_test: serve the registered model, ask it real questions, promote or
roll back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import requests

from kubellm import platform
from kubellm.jobs import JobFailed
from kubellm.serve.base import Endpoint, ServeRequest
from kubellm.stage import StageContext

SMOKE_PROMPTS = 8
MIN_AGREEMENT = 0.9


def run_deploy(ctx: StageContext, model_dir: str | Path, version: str) -> str:
    cfg = ctx.cfg
    with ctx.tracker.stage(ctx.parent_run_id, "deploy") as run_id:
        ws = ctx.workspace
        shared = ws.share(model_dir, "serve", f"v{version}")
        request = ServeRequest(
            name=cfg.model_name,
            model_uri=ws.model_uri(shared),
            namespace=cfg.namespace,
            image=cfg.serving_image,
            timeout_s=cfg.job_timeout_minutes * 60.0,
            run_tag=ctx.kfp_run_id,
        )
        endpoint = platform.server(cfg).deploy(request)
        ctx.tracker.log(
            run_id,
            params={"model_version": version, "model_uri": request.model_uri},
            tags={"kubellm.endpoint": endpoint.url},
        )
    return endpoint.url


def ask(endpoint: Endpoint, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
    body = {"instances": [{"prompt": p, "max_new_tokens": max_new_tokens} for p in prompts]}
    r = requests.post(endpoint.predict_url, json=body, timeout=120)
    if r.status_code != 200:
        raise JobFailed(f"{endpoint.predict_url} answered {r.status_code}: {r.text[:300]}")
    predictions = r.json().get("predictions")
    if not isinstance(predictions, list) or len(predictions) != len(prompts):
        raise JobFailed(f"{endpoint.predict_url} returned {r.text[:300]}")
    return [str(p) for p in predictions]


def run_smoke_test(
    ctx: StageContext, endpoint_url: str, predictions_path: str | Path, version: str
) -> dict[str, Any]:
    """Real prompts to the served model: its answers must match what evaluate saw offline.

    On success the version becomes `champion`; on failure the deployment is rolled back
    (deleted) and the step fails with the reason.
    """
    cfg = ctx.cfg
    endpoint = Endpoint(cfg.model_name, endpoint_url)
    expected = json.loads(Path(predictions_path).read_text())[:SMOKE_PROMPTS]
    if not expected:
        raise JobFailed("evaluate recorded no held-out prompts to smoke-test with")
    with ctx.tracker.stage(ctx.parent_run_id, "smoke_test") as run_id:
        prompts = [e["prompt"] for e in expected]
        # same decoding budget as evaluate, so the answers are comparable token for token
        answers = ask(endpoint, prompts, int(expected[0].get("max_new_tokens", 8)))
        agree = sum(a == e["prediction"] for a, e in zip(answers, expected, strict=True))
        correct = sum(a == e["completion"] for a, e in zip(answers, expected, strict=True))
        agreement = agree / len(expected)
        result = {
            "prompt": prompts[0],
            "answer": answers[0],
            "expected": expected[0]["completion"],
            "agreement": agreement,
            "served_exact_match": correct / len(expected),
        }
        ctx.tracker.log(
            run_id,
            metrics={"agreement": agreement, "served_exact_match": correct / len(expected)},
            params={"prompt": prompts[0], "answer": answers[0], "expected": result["expected"]},
        )
        if agreement < MIN_AGREEMENT:
            platform.server(cfg).delete(cfg.model_name, ctx.kfp_run_id)
            raise JobFailed(
                f"served answers match the evaluated model on {agree}/{len(expected)} prompts "
                f"(< {MIN_AGREEMENT:.0%}); rolled back {cfg.model_name}"
            )
        ctx.tracker.client.set_registered_model_alias(cfg.model_name, "champion", version)
        print(
            f"smoke_test: {prompts[0]!r} -> {answers[0]!r} "
            f"(expected {expected[0]['completion']!r}); agreement {agree}/{len(expected)}; "
            f"version {version} is champion",
            flush=True,
        )
    return result
