"""The evaluate stage on chats (issue 21): a user task of chats (eval_data with `messages`) is
asked in the candidate's own chat template, and the champion, whose template differs, is
asked the same chats in its own, as each model's server would be asked them.

The candidate is a tiny Llama-3-style chat model (tests/fixtures/llama_chat.py, saved with
save_pretrained) with a dataset prepared on its tokenizer; the champion is the chain's
registered model (kubellm's default template on a byte-level BPE)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixtures.llama_chat import BOS, HEADER, build_model, chat_records

from kubellm.stages import evaluate
from kubellm.stages.context import StageContext
from stages.conftest import Chain, side_context


@dataclass(frozen=True)
class ChatCandidate:
    model: Path
    dataset: Path
    task: Path


@pytest.fixture(scope="module")
def chat_candidate(chain: Chain) -> ChatCandidate:
    from kubellm.data.prepare import PrepareParams, prepare

    model = build_model(chain.root / "llama-chat-model")
    source = chain.root / "llama-chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in chat_records(80)))
    dataset = chain.root / "llama-chat-dataset"
    prepare(
        PrepareParams(
            source=str(source),
            template="messages",
            tokenizer=str(model),
            seq_len=128,
            packing="best_fit",
            progress_s=0,
        ),
        dataset,
    )
    task = chain.root / "chat-task.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in chat_records(6, seed=7)))
    return ChatCandidate(model, dataset, task)


def test_a_chat_task_is_asked_in_each_models_own_template(
    chain: Chain, ctx: StageContext, chat_candidate: ChatCandidate, champion_v1: str
) -> None:
    """Was: `load_task` refused chat records in the stage (no chat format given), and the
    champion would have been asked the candidate's rendering."""
    side = side_context(ctx, "chat-task", eval_data=str(chat_candidate.task))
    out = chain.root / "chat-predictions.json"
    result = evaluate.run(
        side, chat_candidate.model, chat_candidate.dataset, str(out), str(out.with_suffix(".html"))
    )
    ours = json.loads(out.read_text())
    assert len(ours) == 6 and result.metrics["eval_examples"] == 6
    for p in ours:  # the candidate's (Llama 3) format, ending in its generation prompt
        assert p["prompt"].startswith(BOS + HEADER[0])
        assert p["prompt"].endswith(f"{HEADER[0]}assistant{HEADER[1]}\n\n")
    run = side.stage_runs()["evaluate"]
    saved = side.tracker.client.download_artifacts(run.info.run_id, "champion_predictions.json")
    theirs = json.loads(Path(saved).read_text())
    assert len(theirs) == 6
    for mine, champ in zip(ours, theirs, strict=True):  # kubellm's default format
        assert champ["completion"] == mine["completion"]
        assert champ["prompt"].startswith("<|") and HEADER[0] not in champ["prompt"]
        assert champ["prompt"].endswith("<|assistant|>\n")
    assert f"champion v{champion_v1}" in result.reason
