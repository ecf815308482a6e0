"""kubellm.evaluate.gate: the decision table, one check per reason."""

from __future__ import annotations

import math

import pytest

from kubellm.evaluate.gate import PROMOTE, REJECT, Champion, decide

ARITH = {"exact_match": 0.8, "eval_loss": 0.30, "perplexity": math.exp(0.30)}
TEXT = {"eval_loss": 2.0, "perplexity": math.exp(2.0)}  # plain text: no exact match


def test_without_a_champion_the_absolute_bar_decides() -> None:
    ok = decide(ARITH, None, min_accuracy=0.2)
    assert (ok.decision, ok.metric, ok.reason) == (
        PROMOTE,
        "exact_match",
        "exact_match 0.800 >= gate_min_accuracy 0.200",
    )
    low = decide(ARITH, None, min_accuracy=0.9)
    assert (low.decision, low.reason) == (REJECT, "exact_match 0.800 < gate_min_accuracy 0.900")


def test_plain_text_gates_on_perplexity_and_a_missing_exact_match_is_not_zero() -> None:
    auto = decide(TEXT, None, max_perplexity=100.0)
    assert (auto.decision, auto.metric) == (PROMOTE, "perplexity")
    assert auto.reason == "perplexity 7.389 <= gate_max_perplexity 100"
    assert decide(TEXT, None, max_perplexity=5.0).decision == REJECT
    asked = decide(TEXT, None, asked="exact_match")
    assert asked.decision == REJECT
    assert "no prompt/answer examples (plain text)" in asked.reason  # not "0.000 < ..."
    diverged = decide({"eval_loss": math.nan}, None, asked="eval_loss", max_perplexity=1e9)
    assert diverged.decision == REJECT


@pytest.mark.parametrize(
    ("metric", "candidate", "champion", "margin", "decision"),
    [
        ("exact_match", 0.80, 0.75, 0.0, PROMOTE),
        ("exact_match", 0.80, 0.75, 0.1, REJECT),  # better, but not by the margin
        ("exact_match", 0.70, 0.75, 0.0, REJECT),  # a worse model never replaces a better one
        ("eval_loss", 0.30, 0.35, 0.04, PROMOTE),  # lower is better
        ("eval_loss", 0.40, 0.35, 0.0, REJECT),
        ("perplexity", 1.30, 1.30, 0.0, REJECT),  # a tie is not an improvement
        ("exact_match", 0.80, 0.80, 0.0, REJECT),
        ("eval_loss", 0.30, 0.30 + 1e-13, 0.0, REJECT),  # float rounding is a tie too
        ("eval_loss", 0.30, 0.3001, 0.0, PROMOTE),  # strictly better
        ("exact_match", 0.80, 0.75, 0.05, PROMOTE),  # by the margin exactly
        # by the margin exactly, where the subtraction rounds below it (0.04999999999999999)
        ("exact_match", 0.30, 0.25, 0.05, PROMOTE),
        ("eval_loss", 0.25, 0.30, 0.05, PROMOTE),
        ("exact_match", 0.30, 0.25, 0.050001, REJECT),  # the tolerance is rounding only
    ],
)
def test_the_champion_must_be_beaten_by_the_margin(
    metric: str, candidate: float, champion: float, margin: float, decision: str
) -> None:
    mine = {**ARITH, metric: candidate}
    theirs = Champion("3", {**ARITH, metric: champion})
    result = decide(mine, theirs, asked=metric, margin=margin, max_perplexity=1e9)
    assert result.decision == decision, result.reason
    assert f"vs champion v3 {champion:.4g} on this data" in result.reason


def test_guards_bound_how_much_worse_the_other_metrics_may_get() -> None:
    # the candidate beats it on exact_match (0.80 vs 0.75): the guards decide
    theirs = Champion("1", {**ARITH, "exact_match": 0.75, "eval_loss": 0.30})
    within = decide({**ARITH, "eval_loss": 0.31}, theirs, guards={"eval_loss": 0.05})
    assert within.decision == PROMOTE, within.reason
    assert "guard eval_loss 0.31 vs champion 0.3: +3.3% <= 5.0% worse" in within.reason
    beyond = decide({**ARITH, "eval_loss": 0.33}, theirs, guards={"eval_loss": 0.05})
    assert beyond.decision == REJECT
    assert "+10.0% > 5.0% worse" in beyond.reason
    better = decide({**ARITH, "eval_loss": 0.20}, theirs, guards={"eval_loss": 0.0})
    assert better.decision == PROMOTE, better.reason  # improving a guard is always fine
    # worse by the bound exactly, where the division rounds above it (0.10000000000000009)
    at = Champion("1", {**ARITH, "exact_match": 0.75, "eval_loss": 0.7})
    bound = decide({**ARITH, "eval_loss": 0.77}, at, guards={"eval_loss": 0.1})
    assert bound.decision == PROMOTE, bound.reason
    assert "+10.0% <= 10.0% worse" in bound.reason


def test_generation_speed_guards_know_their_direction() -> None:
    """Latency is worse when higher, throughput when lower."""
    theirs = Champion(
        "1", {**ARITH, "exact_match": 0.75, "gen_latency_ms": 10.0, "gen_tokens_per_sec": 100.0}
    )
    slower = decide(
        {**ARITH, "gen_latency_ms": 13.0, "gen_tokens_per_sec": 100.0},
        theirs,
        guards={"gen_latency_ms": 0.25},
    )
    assert slower.decision == REJECT and "+30.0% > 25.0% worse" in slower.reason
    fewer = decide(
        {**ARITH, "gen_latency_ms": 10.0, "gen_tokens_per_sec": 80.0},
        theirs,
        guards={"gen_tokens_per_sec": 0.1},
    )
    assert fewer.decision == REJECT and "+20.0% > 10.0% worse" in fewer.reason
    faster = decide(
        {**ARITH, "gen_latency_ms": 5.0, "gen_tokens_per_sec": 200.0},
        theirs,
        guards={"gen_latency_ms": 0.0, "gen_tokens_per_sec": 0.0},
    )
    assert faster.decision == PROMOTE, faster.reason


def test_a_champion_that_cannot_be_measured_on_this_metric_is_not_beaten() -> None:
    """Was: PROMOTE, "champion v2 has no perplexity on this data"."""
    theirs = Champion("2", {"exact_match": 0.9})
    result = decide(TEXT, theirs, max_perplexity=100.0)
    assert result.decision == REJECT
    assert "perplexity: the champion has none on this data (not measured)" in result.reason
    assert "champion v2 cannot be compared, so it stays" in result.reason
    allowed = decide(TEXT, theirs, max_perplexity=100.0, allow_incomparable=True)
    assert allowed.decision == PROMOTE, allowed.reason
    assert "not compared (gate_allow_incomparable=true: the absolute bar decides)" in (
        allowed.reason
    )


def test_across_tokenizers_a_token_loss_gate_compares_bits_per_byte() -> None:
    differ = "champion vocab 300, candidate 1024"
    mine = {**TEXT, "bits_per_byte": 1.10}
    theirs = Champion("4", {"bits_per_byte": 1.20}, tokenizer_differs=differ)
    better = decide(mine, theirs, asked="perplexity", max_perplexity=100.0)
    assert better.decision == PROMOTE, better.reason
    assert better.reasons[1] == (
        f"tokenizers differ ({differ}): compared on bits_per_byte; bits_per_byte 1.1 vs "
        "champion v4 1.2 on this data: improvement +0.1 > 0 (a tie keeps the champion)"
    )
    worse = decide({**mine, "bits_per_byte": 1.3}, theirs, asked="eval_loss", max_perplexity=100)
    assert worse.decision == REJECT and "compared on bits_per_byte" in worse.reason
    # a token-loss guard cannot be judged across tokenizers; it says so instead of passing
    # silently as "not measured"
    guarded = decide(mine, theirs, asked="perplexity", max_perplexity=100, guards={"eval_loss": 0})
    assert "guard eval_loss: not comparable across tokenizers" in guarded.reason
    # the champion without bits_per_byte (scored by an older kubellm, say): no comparison
    bare = Champion("4", {}, tokenizer_differs=differ)
    blind = decide(mine, bare, asked="perplexity", max_perplexity=100.0)
    assert blind.decision == REJECT
    assert "bits_per_byte: the champion has none on this data (the tokenizers differ)" in (
        blind.reason
    )


def test_one_more_right_answer_does_not_buy_a_much_worse_loss() -> None:
    """Exact match +0.004 (one more right of 256) with held-out loss 50 % worse: rejected by
    the default guard (gate_guards' default, bits_per_byte at most 5 % worse). Was:
    promoted, there being no default guard."""
    from kubellm.config import PipelineConfig

    champion = {"exact_match": 0.500, "eval_loss": 0.40, "bits_per_byte": 0.80}
    mine = {"exact_match": 0.504, "eval_loss": 0.60, "bits_per_byte": 1.20}
    default = PipelineConfig().gate_guards
    assert default == {"bits_per_byte": 0.05}
    for guards in (None, default):  # decide's default is the config's
        result = decide(mine, Champion("7", champion), min_accuracy=0.2, guards=guards)
        assert result.decision == REJECT, result.reason
        assert "improvement +0.004 > 0" in result.reason  # the gate metric itself passed
        assert "guard bits_per_byte 1.2 vs champion 0.8: +50.0% > 5.0% worse" in result.reason
    # within the bound it promotes; gate_guards={} turns guards off
    near = {**mine, "bits_per_byte": 0.82}
    assert decide(near, Champion("7", champion), min_accuracy=0.2).decision == PROMOTE
    off = decide(mine, Champion("7", champion), min_accuracy=0.2, guards={})
    assert off.decision == PROMOTE and "guard" not in off.reason


def test_a_bits_per_byte_gate_has_the_perplexity_bar() -> None:
    mine = {**TEXT, "bits_per_byte": 1.5}
    ok = decide(mine, None, asked="bits_per_byte", max_perplexity=100.0)
    assert (ok.decision, ok.metric) == (PROMOTE, "bits_per_byte")
    assert ok.reason == "perplexity 7.389 <= gate_max_perplexity 100"
    assert decide(mine, None, asked="bits_per_byte", max_perplexity=5.0).decision == REJECT
