"""The gate when the tokenizer changes (issue 21): the champion is the chain's registered
model (a byte-level BPE of the arithmetic data: the byte alphabet and the specials, 258);
the candidate has a richer BPE (vocab_size 1024) trained on words and sums. The champion's
held-out loss on the candidate's token ids is meaningless (and crashed: its embedding has no
rows for most of them), so it is scored on its own tokenization of the same held-out texts
and the gate compares bits per byte."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from kubellm.stages import evaluate, summarize
from kubellm.stages.context import StageContext
from stages.conftest import Chain, side_context


@dataclass(frozen=True)
class Candidate:
    dataset: Path
    model: Path
    vocab: int


@pytest.fixture(scope="module")
def richer(chain: Chain) -> Candidate:
    """A dataset of the chain's kind of records with a vocab-1024 BPE, and a (random,
    seeded) model of that tokenizer saved with save_pretrained."""
    import torch

    from kubellm.config import ModelConfig
    from kubellm.data.artifact import tokenizer_dir
    from kubellm.data.prepare import PrepareParams, prepare
    from kubellm.data.tokenizer import load_tokenizer
    from kubellm.train.model import new_llama

    # arithmetic after made-up words: enough distinct text for a BPE of 1024 (digits alone
    # give the byte alphabet and a few merges, whatever vocab_size asks)
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "pe", "du"]
    records = []
    for _ in range(600):
        words = " ".join("".join(rng.choices(syllables, k=rng.randint(2, 3))) for _ in range(2))
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        prompt = f"{words} {a}+{b}="
        records.append({"prompt": prompt, "completion": str(a + b), "text": f"{prompt}{a + b}"})
    src = chain.root / "richer.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = chain.root / "richer-dataset"
    prepare(PrepareParams(source=str(src), vocab_size=1024, seq_len=16), data)
    tokenizer = load_tokenizer(tokenizer_dir(data))
    torch.manual_seed(0)
    model = new_llama(ModelConfig(hidden_size=32, num_layers=1, num_heads=2), tokenizer)
    out = chain.root / "richer-model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Candidate(data, out, len(tokenizer))


def test_a_richer_tokenizer_is_compared_on_bits_per_byte(
    chain: Chain, ctx: StageContext, richer: Candidate, champion_v1: str
) -> None:
    """Was: IndexError (index out of range in self) from the champion's embedding, on every
    run until someone removed the alias; or, when it did not crash, no comparison at all."""
    from kubellm.data.artifact import load_split, tokenizer_dir
    from kubellm.data.tokenizer import load_tokenizer

    theirs = len(load_tokenizer(tokenizer_dir(chain.artifact("dataset"))))
    assert richer.vocab > theirs
    assert int(load_split(str(richer.dataset), "val")[0].max()) >= theirs  # past its embedding
    side = side_context(ctx, "richer-tokenizer", gate_metric="perplexity")
    out = chain.root / "richer-predictions.json"
    result = evaluate.run(
        side, richer.model, richer.dataset, str(out), str(out.with_suffix(".html"))
    )
    metrics = result.metrics
    # the champion scored on its own tokens: bits per byte, no token loss on foreign ids
    assert metrics["champion_bits_per_byte"] > 0 and metrics["bits_per_byte"] > 0
    assert "champion_eval_loss" not in metrics and "champion_perplexity" not in metrics
    differ = f"tokenizers differ (champion vocab {theirs}, candidate {richer.vocab})"
    assert f"{differ}: compared on bits_per_byte; bits_per_byte " in result.reason
    assert f"vs champion v{champion_v1} " in result.reason
    # a random model against a trained one: the champion models the text better, and stays
    assert metrics["bits_per_byte"] > metrics["champion_bits_per_byte"]
    assert result.decision == evaluate.REJECT, result.reason
    tags = side.stage_runs()["evaluate"].data.tags
    assert tags["kubellm.gate_reason"] == result.reason
    page = out.with_suffix(".html").read_text()
    assert "<th>bits_per_byte</th>" in page
    assert differ in page
    assert "| bits_per_byte |" in result.report and "| champion_bits_per_byte |" in result.report


def test_the_default_guard_applies_across_tokenizers_on_an_exact_match_gate(
    chain: Chain, ctx: StageContext, richer: Candidate, champion_v1: str
) -> None:
    """gate_metric auto on prompt/answer data is exact_match: the champion answers the same
    prompts (text, comparable), and the default guard bounds bits per byte."""
    side = side_context(ctx, "richer-exact-match")
    result = evaluate.run(side, richer.model, richer.dataset, str(chain.root / "richer-em.json"))
    assert "champion_exact_match" in result.metrics
    assert "vs champion v" in result.reason
    assert "guard bits_per_byte " in result.reason and "5.0% worse" in result.reason
    assert "guard eval_loss" not in result.reason
    assert result.decision == evaluate.REJECT, result.reason


def test_a_champion_of_the_same_tokenizer_still_compares_on_token_loss(
    chain: Chain, ctx: StageContext, champion_v1: str
) -> None:
    """Same tokenizer: eval_loss and perplexity compare as before, and both models also get
    bits_per_byte from the same code (equal here: the same weights)."""
    side = side_context(ctx, "same-tokenizer", gate_metric="eval_loss", gate_margin=0.01)
    out = chain.root / "same-tokenizer.json"
    result = evaluate.run(side, chain.artifact("model"), chain.artifact("dataset"), str(out))
    assert result.metrics["champion_eval_loss"] == result.metrics["eval_loss"]
    assert result.metrics["champion_bits_per_byte"] == result.metrics["bits_per_byte"]
    assert "tokenizers differ" not in result.reason
    assert result.reason.count("eval_loss ") >= 1 and "improvement +0 < gate_margin 0.01" in (
        result.reason
    )


def test_a_failed_evaluate_is_named_in_the_summary_with_its_errors_last_line(
    chain: Chain, ctx: StageContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary of a run whose evaluate raised names the stage and the error's last line
    (a multi-line error, such as a wrapped traceback, reads as its reason)."""

    def broken(*args: object, **kwargs: object) -> None:
        raise IndexError("while scoring the champion:\n  at row 3\nindex out of range in self")

    monkeypatch.setattr("kubellm.stages.evaluate.evaluate", broken)
    side = side_context(ctx, "evaluate-fails")
    with pytest.raises(IndexError):
        evaluate.run(
            side, chain.artifact("model"), chain.artifact("dataset"), str(chain.root / "x.json")
        )
    report = summarize.run(chain.params, "evaluate-fails", "FAILED", "").report
    listed = report.split("\nFailed stages:\n", 1)[1].splitlines()
    assert listed[0] == "- evaluate: index out of range in self", report
    parent = ctx.tracker.client.get_run(side.parent_run_id)
    assert parent.data.tags["kubellm.error"].startswith("evaluate: index out of range in self")
    assert json.dumps(report)  # one readable text
