"""The gate: does the candidate ship? Pure arithmetic on two sets of held-out metrics.

The candidate and the current champion are measured the same way, by the same code, on the
candidate's evaluation data (kubellm.stages.evaluate loads the champion from the registry);
a champion's own tags, measured on its own data, are never compared. The decision:

- the gate metric (`gate_metric`; auto: exact_match when the data has prompt/answer
  examples, else perplexity) must meet the absolute bar: exact_match >= gate_min_accuracy,
  or perplexity (eval_loss through exp) <= gate_max_perplexity;
- with a champion, the candidate must beat it on the gate metric: strictly (a tie is not an
  improvement: a same-settings retrain scores what the champion scores, and replacing the
  champion with it would be a new version and a rollout for nothing), or by at least
  `gate_margin` when that is above 0 (in the metric's units, in the better direction);
- token losses (eval_loss, perplexity) compare only between models of one tokenizer: when
  the champion's tokenizer is not the candidate's, the comparison is made on bits_per_byte
  (the held-out text's nats / ln 2 / its UTF-8 bytes, each model on its own tokenization of
  the same texts), and the reason says so;
- a champion that cannot be compared on the metric (not measured on this data) rejects the
  candidate, naming why, unless `gate_allow_incomparable` lets the absolute bar decide;
- with a champion, every guard metric (`gate_guards`, {name: relative bound}) may be at most
  that much worse than the champion's. gate_guards' default (DEFAULT_GATE_GUARDS in
  kubellm.config) is bits_per_byte at most 5 % worse, which matters when the gate is on
  exact_match (on a loss gate, beating the champion implies it): exact match moves by whole
  answers (one more right of 256 is +0.004), well inside its sampling noise (a standard
  error near 0.03 at 256 examples), while held-out loss counts every target token of the
  val split. A model that gets one more answer right and models the data markedly worse is
  not better. 5 % lets through the small loss changes retraining brings and stops the
  regressions that matter (a loss 50 % worse). Setting gate_guards replaces it; {} turns
  guards off.

Every check gives one reason; all of them are the KFP output and the MLflow tags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kubellm.config import DEFAULT_GATE_GUARDS

PROMOTE = "promote"
REJECT = "reject"
HIGHER_IS_BETTER = {
    "exact_match": True,
    "eval_loss": False,
    "perplexity": False,
    # tokenizer-independent held-out loss: what loss compares on when tokenizers differ
    "bits_per_byte": False,
    # generation speed: possible guards, e.g. {"gen_latency_ms": 0.25}
    "gen_latency_ms": False,
    "gen_tokens_per_sec": True,
}
# Losses per token: comparable only between models of the same tokenizer.
TOKEN_LOSSES = ("eval_loss", "perplexity")
TOKENIZER_FREE = "bits_per_byte"
# The guards when gate_guards is left at its default (see the module docstring).
DEFAULT_GUARDS = DEFAULT_GATE_GUARDS
# Below this relative difference two measurements of a metric are the same figure (float
# rounding of the same computation batched differently), not an improvement.
TIE = 1e-9


@dataclass(frozen=True)
class Champion:
    version: str
    metrics: dict[str, float]  # measured on the candidate's evaluation data
    # "" when its tokenizer is the candidate's; else how they differ, e.g. "champion vocab
    # 300, candidate 1024": its token losses then are not in `metrics`
    tokenizer_differs: str = ""
    # why it was not measured at all (it does not load, its template cannot ask the task)
    not_measured: str = ""


@dataclass
class Decision:
    decision: str
    metric: str
    reasons: list[str] = field(default_factory=list)
    # per reason, whether that check passed (a promote passed them all)
    passed: list[bool] = field(default_factory=list)

    def checks(self) -> list[tuple[bool | None, str]]:
        """(passed, reason) per check; None where a reason has no outcome recorded."""
        return [
            (self.passed[i] if i < len(self.passed) else None, why)
            for i, why in enumerate(self.reasons)
        ]

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def gate_metric(asked: str, metrics: dict[str, float]) -> str:
    if asked != "auto":
        return asked
    return "exact_match" if "exact_match" in metrics else "perplexity"


def _absolute(
    metric: str, metrics: dict[str, float], min_accuracy: float, max_perplexity: float
) -> tuple[bool, str]:
    value = metrics[metric]
    if metric == "exact_match":
        ok = value >= min_accuracy
        return (
            ok,
            f"exact_match {value:.3f} {'>=' if ok else '<'} gate_min_accuracy {min_accuracy:.3f}",
        )
    if metric == TOKENIZER_FREE:  # the bar is per token: the candidate's own perplexity
        value = metrics.get("perplexity", math.inf)
        metric = "perplexity"
    perplexity = value if metric == "perplexity" else math.exp(min(value, 50.0))
    ok = math.isfinite(perplexity) and perplexity <= max_perplexity
    return ok, (
        f"perplexity {perplexity:.4g} {'<=' if ok else '>'} gate_max_perplexity "
        f"{max_perplexity:.4g}"
    )


def _improvement(metric: str, candidate: float, champion: float) -> float:
    better = candidate - champion if HIGHER_IS_BETTER[metric] else champion - candidate
    return 0.0 if abs(better) <= TIE * max(abs(champion), 1.0) else better


def _reaches(value: float, bar: float, scale: float = 1.0) -> bool:
    """value >= bar, where a difference within float rounding counts as reaching it: 0.30 -
    0.25 is 0.04999999999999999, and a candidate better by exactly gate_margin passes."""
    return value >= bar - TIE * max(abs(scale), 1.0)


def _beats(
    metric: str, metrics: dict[str, float], champion: Champion, margin: float, allow: bool
) -> tuple[bool, str]:
    """The candidate against the champion on `metric` (bits_per_byte for a token loss when
    the tokenizers differ)."""
    compared, said = metric, ""
    if champion.tokenizer_differs and metric in TOKEN_LOSSES:
        compared = TOKENIZER_FREE
        said = f"tokenizers differ ({champion.tokenizer_differs}): compared on {compared}; "
    mine, theirs = metrics.get(compared), champion.metrics.get(compared)
    if mine is None or theirs is None:
        if champion.not_measured:  # its metrics are empty: it is the one missing
            why = f"not measured: {champion.not_measured}"
        else:
            why = "the tokenizers differ" if champion.tokenizer_differs else "not measured"
        missing = "champion" if theirs is None else "candidate"
        if allow:
            return True, (
                f"{said}{compared}: the {missing} has none on this data ({why}); not compared "
                "(gate_allow_incomparable=true: the absolute bar decides)"
            )
        return False, (
            f"{said}{compared}: the {missing} has none on this data ({why}); champion "
            f"v{champion.version} cannot be compared, so it stays (gate_allow_incomparable="
            "true lets the absolute bar decide)"
        )
    better = _improvement(compared, mine, theirs)
    if margin > 0:
        ok, bar = _reaches(better, margin, theirs), f"gate_margin {margin:.4g}"
        sign = ">=" if ok else "<"
    else:  # a tie is not an improvement
        ok, bar = better > 0, "0 (a tie keeps the champion)"
        sign = ">" if ok else "<="
    return ok, (
        f"{said}{compared} {mine:.4g} vs champion v{champion.version} {theirs:.4g} on this "
        f"data: improvement {better:+.4g} {sign} {bar}"
    )


def decide(
    metrics: dict[str, float],
    champion: Champion | None,
    *,
    asked: str = "auto",
    min_accuracy: float = 0.0,
    max_perplexity: float = math.inf,
    margin: float = 0.0,
    guards: dict[str, float] | None = None,
    allow_incomparable: bool = False,
) -> Decision:
    """`guards` None: DEFAULT_GUARDS; {}: none."""
    metric = gate_metric(asked, metrics)
    if metric not in metrics:
        return Decision(
            REJECT,
            metric,
            [
                f"{metric}: the evaluation data has no prompt/answer examples (plain text); "
                "gate on perplexity (gate_metric=auto or perplexity)"
            ],
            [False],
        )
    checks = [_absolute(metric, metrics, min_accuracy, max_perplexity)]
    if champion is not None:
        checks.append(_beats(metric, metrics, champion, margin, allow_incomparable))
        for name, bound in sorted((DEFAULT_GUARDS if guards is None else guards).items()):
            mine, theirs = metrics.get(name), champion.metrics.get(name)
            if champion.tokenizer_differs and name in TOKEN_LOSSES:
                checks.append(
                    (True, f"guard {name}: not comparable across tokenizers (see bits_per_byte)")
                )
                continue
            if mine is None or theirs is None:
                checks.append((True, f"guard {name}: not measured on this data"))
                continue
            worse = -_improvement(name, mine, theirs) / max(abs(theirs), 1e-12)
            ok = _reaches(bound, worse)  # worse by the bound exactly is within it
            checks.append(
                (
                    ok,
                    f"guard {name} {mine:.4g} vs champion {theirs:.4g}: {worse:+.1%} "
                    f"{'<=' if ok else '>'} {bound:.1%} worse",
                )
            )
    decision = PROMOTE if all(ok for ok, _ in checks) else REJECT
    return Decision(decision, metric, [why for _, why in checks], [ok for ok, _ in checks])
