"""The smoke_test stage: real prompts to the new version's own address; promote or roll back.

The deploy stage left the new version ready: alone (a first deployment) or as a canary
beside the previous version. Here the served answers must equal what evaluate saw offline.
A chat example (held-out chat records, which carry their messages) is asked on the chat
completions route, so the server renders the prompt with the model's own chat template: the
answer equals evaluate's only if that rendering is the one evaluate (and training) used.
Then either the new version takes all traffic and becomes `champion`, or, on any failure
(wrong answers, an HTTP error, a timeout), traffic goes back to the previous version, or a
first deployment is removed, `champion` stays where it was, and the step fails with the
reason. Nothing is deleted while a previous version could serve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubellm.backends.base import JobFailed
from kubellm.serve.client import Endpoint, ServingError, chat, complete
from kubellm.stages.context import StageContext, StageResult
from kubellm.tracking import CHAMPION

SMOKE_PROMPTS = 8
MIN_AGREEMENT = 0.9
# Where evaluate's top two logits were this close, another runtime, batch or kernel may pick
# the other token: a served answer that differs there is not counted against the model.
NEAR_TIE = 1e-4


@dataclass
class Result(StageResult):
    prompt: str = ""
    answer: str = ""
    expected: str = ""
    agreement: float = 0.0
    served_exact_match: float = 0.0
    near_ties: int = 0  # differing answers excused as near-ties
    endpoint: str = ""  # where the promoted version serves all traffic
    chats: int = 0  # examples asked on the chat completions route


def answers(
    endpoint: Endpoint, expected: list[dict[str, Any]], max_tokens: int, timeout_s: float
) -> list[str]:
    """The served greedy answers, one request each: a chat example (`messages`, JSON) on the
    chat completions route, a prompt on the completions route."""
    out = []
    for e in expected:
        if e.get("messages"):
            out.append(chat(endpoint, json.loads(e["messages"]), max_tokens, timeout_s))
        else:
            out.append(complete(endpoint, e["prompt"], max_tokens, timeout_s))
    return out


def agreement(answers: list[str], expected: list[dict[str, Any]]) -> tuple[int, int]:
    """(answers equal to the evaluated ones, differing ones excused as near-ties)."""
    same = sum(a == e["prediction"] for a, e in zip(answers, expected, strict=True))
    excused = sum(
        a != e["prediction"] and float(e.get("min_logit_gap", float("inf"))) < NEAR_TIE
        for a, e in zip(answers, expected, strict=True)
    )
    return same, excused


def run(ctx: StageContext, endpoint_url: str, predictions_path: str | Path, version: str) -> Result:
    """Smoke-test version `version` at `endpoint_url` (its own address), then promote it to
    all traffic and `champion`, or roll back and fail with the reason."""
    cfg = ctx.cfg
    server = ctx.backends.server
    endpoint = Endpoint(cfg.model_name, endpoint_url)
    expected = json.loads(Path(predictions_path).read_text())[:SMOKE_PROMPTS]
    if not expected:
        raise JobFailed("evaluate recorded no held-out prompts to smoke-test with")

    def roll_back(why: str) -> JobFailed:
        try:
            done = server.rollback(cfg.model_name, ctx.kfp_run_id, cfg.namespace)
        except Exception as err:  # the reason for the rollback must not be lost
            done = f"the rollback failed too: {err}"
        return JobFailed(f"{why}; {done}; champion unchanged")

    with ctx.stage("smoke_test") as run_id:
        prompts = [e["prompt"] for e in expected]
        try:
            # same decoding budget as evaluate, so the answers are comparable token for token
            served = answers(
                endpoint,
                expected,
                int(expected[0].get("max_new_tokens", 8)),
                timeout_s=cfg.smoke_timeout_seconds,
            )
        except ServingError as err:
            raise roll_back(f"smoke test of {cfg.model_name} v{version}: {err}") from None
        same, excused = agreement(served, expected)
        correct = sum(a == e["completion"] for a, e in zip(served, expected, strict=True))
        n = len(expected)
        chats = sum(1 for e in expected if e.get("messages"))
        result = Result(
            metrics={"agreement": same / n, "served_exact_match": correct / n},
            prompt=prompts[0],
            answer=served[0],
            expected=expected[0]["completion"],
            agreement=same / n,
            served_exact_match=correct / n,
            near_ties=excused,
            chats=chats,
        )
        params = {"prompt": result.prompt, "answer": result.answer, "expected": result.expected}
        params["route"] = "chat/completions" if expected[0].get("messages") else "completions"
        ctx.tracker.log(
            run_id, metrics={**result.metrics, "near_ties": float(excused)}, params=params
        )
        if (same + excused) / n < MIN_AGREEMENT:
            raise roll_back(
                f"served answers match the evaluated model on {same}/{n} prompts "
                f"({excused} near-ties excused; < {MIN_AGREEMENT:.0%})"
            )
        result.endpoint = server.promote(cfg.model_name, cfg.namespace).url
        ctx.tracker.client.set_registered_model_alias(cfg.model_name, CHAMPION, version)
    ties = f", {excused} near-tie(s) excused" if excused else ""
    if result.chats:
        ties += f" ({result.chats} on the chat completions route)"
    result.report = (
        f"# Smoke test\n\n`{result.prompt}` -> `{result.answer}` (expected `{result.expected}`); "
        f"served = evaluated on {same}/{n} prompts{ties}; version {version} takes all traffic "
        f"at {result.endpoint} and is champion\n"
    )
    result.headline = (
        f"{result.prompt!r} -> {result.answer!r} (expected {result.expected!r}); "
        f"agreement {same}/{n}{ties}; version {version} is champion"
    )
    return ctx.finish("smoke_test", result)
