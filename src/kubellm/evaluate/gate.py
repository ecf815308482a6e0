"""The gate: does the candidate ship? Pure arithmetic on two sets of held-out metrics.

The candidate and the current champion are measured the same way, by the same code, on the
candidate's evaluation data (kubellm.stages.evaluate loads the champion from the registry);
a champion's own tags, measured on its own data, are never compared. The decision:

- the gate metric (`gate_metric`; auto: exact_match when the data has prompt/answer
  examples, else perplexity) must meet the absolute bar: exact_match >= gate_min_accuracy,
  or perplexity (eval_loss through exp) <= gate_max_perplexity;
- with a champion, the candidate must beat it on the gate metric by at least `gate_margin`
  (in the metric's units, in the better direction);
- with a champion, every guard metric (`gate_guards`, {name: relative bound}) may be at most
  that much worse than the champion's.

Every check gives one reason; all of them are the KFP output and the MLflow tags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PROMOTE = "promote"
REJECT = "reject"
HIGHER_IS_BETTER = {
    "exact_match": True,
    "eval_loss": False,
    "perplexity": False,
    # generation speed: possible guards, e.g. {"gen_latency_ms": 0.25}
    "gen_latency_ms": False,
    "gen_tokens_per_sec": True,
}


@dataclass(frozen=True)
class Champion:
    version: str
    metrics: dict[str, float]  # measured on the candidate's evaluation data


@dataclass
class Decision:
    decision: str
    metric: str
    reasons: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def gate_metric(asked: str, metrics: dict[str, float]) -> str:
    if asked != "auto":
        return asked
    return "exact_match" if "exact_match" in metrics else "perplexity"


def _absolute(
    metric: str, value: float, min_accuracy: float, max_perplexity: float
) -> tuple[bool, str]:
    if metric == "exact_match":
        ok = value >= min_accuracy
        return (
            ok,
            f"exact_match {value:.3f} {'>=' if ok else '<'} gate_min_accuracy {min_accuracy:.3f}",
        )
    perplexity = value if metric == "perplexity" else math.exp(min(value, 50.0))
    ok = math.isfinite(perplexity) and perplexity <= max_perplexity
    return ok, (
        f"perplexity {perplexity:.4g} {'<=' if ok else '>'} gate_max_perplexity "
        f"{max_perplexity:.4g}"
    )


def _improvement(metric: str, candidate: float, champion: float) -> float:
    return candidate - champion if HIGHER_IS_BETTER[metric] else champion - candidate


def decide(
    metrics: dict[str, float],
    champion: Champion | None,
    *,
    asked: str = "auto",
    min_accuracy: float = 0.0,
    max_perplexity: float = math.inf,
    margin: float = 0.0,
    guards: dict[str, float] | None = None,
) -> Decision:
    metric = gate_metric(asked, metrics)
    if metric not in metrics:
        return Decision(
            REJECT,
            metric,
            [
                f"{metric}: the evaluation data has no prompt/answer examples (plain text); "
                "gate on perplexity (gate_metric=auto or perplexity)"
            ],
        )
    value = metrics[metric]
    ok, why = _absolute(metric, value, min_accuracy, max_perplexity)
    checks = [(ok, why)]
    if champion is not None:
        theirs = champion.metrics.get(metric)
        if theirs is None:
            checks.append((True, f"champion v{champion.version} has no {metric} on this data"))
        else:
            better = _improvement(metric, value, theirs)
            ok = better >= margin
            checks.append(
                (
                    ok,
                    f"{metric} {value:.4g} vs champion v{champion.version} {theirs:.4g} on this "
                    f"data: improvement {better:+.4g} {'>=' if ok else '<'} gate_margin "
                    f"{margin:.4g}",
                )
            )
        for name, bound in sorted((guards or {}).items()):
            mine, theirs = metrics.get(name), champion.metrics.get(name)
            if mine is None or theirs is None:
                checks.append((True, f"guard {name}: not measured on this data"))
                continue
            worse = -_improvement(name, mine, theirs) / max(abs(theirs), 1e-12)
            ok = worse <= bound
            checks.append(
                (
                    ok,
                    f"guard {name} {mine:.4g} vs champion {theirs:.4g}: {worse:+.1%} "
                    f"{'<=' if ok else '>'} {bound:.1%} worse",
                )
            )
    decision = PROMOTE if all(ok for ok, _ in checks) else REJECT
    return Decision(decision, metric, [why for _, why in checks])
