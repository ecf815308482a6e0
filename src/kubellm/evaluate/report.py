"""The evaluation report as one self-contained HTML page: what a person opens to see why the
gate decided as it did.

KFP's UI renders an `Output[HTML]` artifact in a frame, and the same file is an artifact of
the evaluate MLflow run; either may be read where nothing outside can be reached. So the page
carries everything inline: its CSS in one `<style>`, the loss curve as an SVG drawn here (no
plotting library, no JavaScript). Prompts and generations are user data, and so are metric
names and reasons: every piece of text is escaped, never trusted as markup.

The page: the decision with every reason of the gate, the gate's settings, the candidate
against the champion on the same data, the training loss curve, and sample generations of
both models next to the expected answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from kubellm.evaluate.gate import HIGHER_IS_BETTER, PROMOTE, Champion, Decision

MAX_TEXT = 400  # characters of a prompt or generation shown; the rest is counted, not shown
MAX_SAMPLES = 8
MAX_CHART_POINTS = 2000  # more than a chart's width resolves; longer histories are thinned
MAX_MARKERS = 200  # a dot with a hover title per point up to this many points

# The metrics in the order a reader looks for them; others follow alphabetically.
METRIC_ORDER = ("exact_match", "eval_loss", "perplexity", "bits_per_byte", "eval_examples")


@dataclass(frozen=True)
class Sample:
    """One held-out example with what each model generated (champion: None without one)."""

    prompt: str
    expected: str
    candidate: str
    champion: str | None = None


def pair_samples(
    candidate: Sequence[Mapping[str, Any]],
    champion: Sequence[Mapping[str, Any]] | None = None,
    limit: int = MAX_SAMPLES,
) -> list[Sample]:
    """Up to `limit` examples with both models' generations, those where the models disagree
    first (they show what changed), each group in the order of the evaluation data.

    Both lists are `kubellm.evaluate.metrics.evaluate` predictions ({prompt, completion,
    prediction}) on the same data; they are joined on (prompt, completion), not on position,
    so that a champion scored on fewer examples pairs only where it was asked."""
    theirs: dict[tuple[str, str], str] = {}
    for p in champion or ():
        theirs.setdefault((str(p["prompt"]), str(p["completion"])), str(p["prediction"]))
    paired = []
    for p in candidate:
        key = (str(p["prompt"]), str(p["completion"]))
        paired.append(Sample(key[0], key[1], str(p["prediction"]), theirs.get(key)))
    if champion is not None:
        paired.sort(key=lambda s: s.champion is None or s.champion == s.candidate)
    return paired[:limit]


def html_report(
    *,
    candidate: Mapping[str, float],
    champion: Champion | None,
    gate: Decision,
    loss: Sequence[tuple[float, float]],
    samples: Sequence[Sample] = (),
    total_examples: int | None = None,
    settings: Mapping[str, Any] | None = None,
    about: Mapping[str, Any] | None = None,
    no_champion: str = "no champion yet",
    loss_name: str = "loss",
    no_loss: str = "",
    title: str = "Evaluation report",
) -> str:
    """One HTML document: the decision and its reasons, the gate's settings, the metrics of
    the candidate and the champion (or `no_champion`, why there is none), the training loss
    curve (`loss`: (step, value) pairs of the metric `loss_name`; `no_loss`: why there are
    none), and sample generations (`total_examples`: how many were evaluated, of which
    `samples` are shown)."""
    against = f"champion v{champion.version}" if champion is not None else no_champion
    body = [
        f"<h1>{_e(title)}</h1>",
        _key_values(about or {}, "about"),
        _decision(gate, against),
        _key_values(settings or {}, "settings", "Gate settings"),
        "<h2>Candidate vs champion</h2>",
        _metrics_table(candidate, champion, gate.metric, no_champion),
        f"<h2>Training {_e(loss_name)}</h2>",
        _loss_section(loss, loss_name, no_loss),
        "<h2>Sample generations</h2>",
        _samples_table(samples, champion, total_examples),
    ]
    verdict = gate.decision.upper()
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_e(title)}: {_e(verdict)}</title>\n"
        f"<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(part for part in body if part)
        + "\n<footer>kubellm evaluate</footer>\n</body>\n</html>\n"
    )


def svg_line_chart(
    points: Iterable[tuple[float, float]],
    *,
    x_label: str = "step",
    y_label: str = "loss",
    width: int = 640,
    height: int = 300,
) -> str:
    """An inline SVG line chart of (x, y) points with axes, tick values and axis labels.

    Points whose x or y is not finite are left out (a diverged step logs NaN or inf); a
    repeated x keeps its last point (a resumed run logs its steps again); beyond
    MAX_CHART_POINTS the line is thinned evenly, first and last kept. Raises ValueError when
    no finite point is left: the caller says so in words instead of drawing empty axes."""
    clean = _chart_points(points)
    if not clean:
        raise ValueError("no finite points to draw")
    left, right, top, bottom = 72, 16, 12, 48
    plot_w, plot_h = width - left - right, height - top - bottom
    xs, ys = [p[0] for p in clean], [p[1] for p in clean]
    x_ticks = _ticks(min(xs), max(xs), integer=all(float(x).is_integer() for x in xs))
    y_ticks = _ticks(min(ys), max(ys))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + plot_h - (y - y0) / (y1 - y0) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{_e(y_label)} by {_e(x_label)}">',
        f"<title>{_e(y_label)} by {_e(x_label)}</title>",
        '<g class="grid" stroke="#e3e3e3" stroke-width="1">'
        + "".join(
            f'<line x1="{left}" y1="{sy(t):.2f}" x2="{left + plot_w}" y2="{sy(t):.2f}"/>'
            for t in y_ticks
        )
        + "</g>",
        f'<g class="axes" stroke="#444" stroke-width="1">'
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}"/></g>',
        '<g class="x-ticks" font-size="11" text-anchor="middle" fill="#444">'
        + "".join(
            f'<line x1="{sx(t):.2f}" y1="{top + plot_h}" x2="{sx(t):.2f}" '
            f'y2="{top + plot_h + 4}" stroke="#444"/>'
            f'<text x="{sx(t):.2f}" y="{top + plot_h + 16}">{_tick_label(t, x_ticks)}</text>'
            for t in x_ticks
        )
        + "</g>",
        '<g class="y-ticks" font-size="11" text-anchor="end" fill="#444">'
        + "".join(
            f'<line x1="{left - 4}" y1="{sy(t):.2f}" x2="{left}" y2="{sy(t):.2f}" '
            f'stroke="#444"/>'
            f'<text x="{left - 6}" y="{sy(t) + 4:.2f}">{_tick_label(t, y_ticks)}</text>'
            for t in y_ticks
        )
        + "</g>",
        f'<text class="x-label" x="{left + plot_w / 2:.2f}" y="{height - 8}" '
        f'font-size="12" text-anchor="middle">{_e(x_label)}</text>',
        f'<text class="y-label" x="14" y="{top + plot_h / 2:.2f}" font-size="12" '
        f'text-anchor="middle" transform="rotate(-90 14 {top + plot_h / 2:.2f})">'
        f"{_e(y_label)}</text>",
        '<polyline class="series" fill="none" stroke="#1f6feb" stroke-width="2" '
        'stroke-linejoin="round" points="'
        + " ".join(f"{sx(x):.2f},{sy(y):.2f}" for x, y in clean)
        + '"/>',
    ]
    if len(clean) <= MAX_MARKERS:
        out.append(
            '<g class="markers" fill="#1f6feb">'
            + "".join(
                f'<circle cx="{sx(x):.2f}" cy="{sy(y):.2f}" r="3">'
                f"<title>{_e(x_label)} {_num(x)}: {_e(y_label)} {_num(y)}</title></circle>"
                for x, y in clean
            )
            + "</g>"
        )
    out.append("</svg>")
    return "\n".join(out)


def _chart_points(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    by_x: dict[float, float] = {}
    for x, y in points:
        x, y = float(x), float(y)
        if math.isfinite(x) and math.isfinite(y):
            by_x.pop(x, None)  # the last one logged wins
            by_x[x] = y
    clean = sorted(by_x.items())
    if len(clean) > MAX_CHART_POINTS:
        n = len(clean) - 1
        keep = sorted({round(i * n / (MAX_CHART_POINTS - 1)) for i in range(MAX_CHART_POINTS)})
        clean = [clean[i] for i in keep]
    return clean


def _ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten apart) covering [lo, hi]; the
    first and last are the axis bounds. A single value gets a range around it."""
    if hi - lo <= 0 or not math.isfinite(hi - lo):
        pad = 1.0 if integer or lo == 0 else abs(lo) * 0.1
        lo, hi = lo - pad, hi + pad
        if not math.isfinite(hi - lo):  # values near the float limit: no rounder bounds
            return [lo, hi] if hi > lo else [-1.0, 1.0]
    raw = (hi - lo) / max(count - 1, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    steps = (1.0, 2.0, 5.0, 10.0) if integer and magnitude < 10 else (1.0, 2.0, 2.5, 5.0, 10.0)
    step = next(m * magnitude for m in steps if m * magnitude >= raw * (1 - 1e-9))
    if integer:
        step = max(1.0, round(step))
    start, end = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [i * step for i in range(start, end + 1)]


def _tick_label(value: float, ticks: Sequence[float]) -> str:
    """A tick value with as many decimals as the tick spacing needs (0.25, not 0.250000001)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    biggest = max(abs(t) for t in ticks)
    if biggest >= 1e6 or (0 < step < 1e-4):
        return f"{value:.3g}"
    decimals = 0
    while decimals < 6 and abs(round(step, decimals) - step) > step * 1e-6:
        decimals += 1
    return f"{value:.{decimals}f}"


def _loss_section(loss: Sequence[tuple[float, float]], name: str, no_loss: str) -> str:
    drawn = _chart_points(loss)
    if not drawn:
        why = (
            f"{len(loss)} points of {name} were logged, none of them a finite number"
            if loss
            else f"No training {name} history: {no_loss or 'the training run logged none'}"
        )
        return f'<p class="empty">{_e(why)}.</p>'
    finite = [(x, y) for x, y in loss if math.isfinite(float(x)) and math.isfinite(float(y))]
    distinct = len({float(x) for x, _ in finite})
    ys = [y for _, y in drawn]
    notes = [
        f"{name} {_num(ys[0])} at step {_num(drawn[0][0])}"
        if len(drawn) == 1
        else f"{len(drawn)} points, {name} {_num(ys[0])} at step {_num(drawn[0][0])} to "
        f"{_num(ys[-1])} at step {_num(drawn[-1][0])} (lowest {_num(min(ys))})"
    ]
    if len(finite) < len(loss):
        notes.append(f"{len(loss) - len(finite)} points that are not finite numbers left out")
    if distinct < len(finite):
        notes.append(f"{len(finite) - distinct} steps logged again: the last value shown")
    if len(drawn) < distinct:
        notes.append(f"thinned from {distinct} points")
    return (
        '<figure class="loss">\n'
        + svg_line_chart(drawn, x_label="step", y_label=name)
        + f"\n<figcaption>{_e('; '.join(notes))}.</figcaption>\n</figure>"
    )


def _decision(gate: Decision, against: str) -> str:
    kind = "promote" if gate.decision == PROMOTE else "reject"
    reasons = "".join(_check_item(ok, why) for ok, why in gate.checks())
    reasons = reasons or "<li>no reason given</li>"
    return (
        f'<section class="decision {kind}">'
        f'<p><span class="badge">{_e(gate.decision.upper())}</span> '
        f"gate metric <code>{_e(gate.metric)}</code>, against {_e(against)}</p>"
        f'<ul class="reasons">{reasons}</ul></section>'
    )


def _check_item(ok: bool | None, why: str) -> str:
    """One gate check: marked pass or fail, so a rejected run shows which check failed."""
    if ok is None:
        return f"<li>{_e(why)}</li>"
    mark, cls = ("&#10003; pass", "pass") if ok else ("&#10007; fail", "fail")
    return f'<li class="{cls}"><span class="mark">{mark}</span> {_e(why)}</li>'


def _key_values(rows: Mapping[str, Any], cls: str, heading: str = "") -> str:
    if not rows:
        return ""
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_num(v))}</td></tr>" for k, v in rows.items())
    head = f"<h2>{_e(heading)}</h2>" if heading else ""
    return f'{head}<table class="{cls}">{cells}</table>'


def _metrics_table(
    candidate: Mapping[str, float],
    champion: Champion | None,
    gate_metric: str,
    no_champion: str,
) -> str:
    names = sorted(
        set(candidate) | set(champion.metrics if champion else ()),
        key=lambda k: (k != gate_metric, k not in METRIC_ORDER, _order(k), k),
    )
    if champion is None:
        head = f'<tr><th>metric</th><th>candidate</th><th class="none">{_e(no_champion)}</th></tr>'
    else:
        head = (
            f"<tr><th>metric</th><th>candidate</th><th>champion v{_e(champion.version)}</th>"
            "<th>candidate − champion</th></tr>"
        )
    rows = []
    for name in names:
        mine = candidate.get(name)
        cls = ' class="gate-metric"' if name == gate_metric else ""
        cells = [f"<th>{_e(name)}</th>", _value_cell(mine)]
        if champion is None:
            cells.append('<td class="none">—</td>')
        else:
            theirs = champion.metrics.get(name)
            cells += [_value_cell(theirs), _delta_cell(name, mine, theirs)]
        rows.append(f"<tr{cls}>{''.join(cells)}</tr>")
    why = (
        "both measured on this run's evaluation data by the same code"
        if champion
        else f"{no_champion}: only the gate's absolute bar applies"
    )
    if champion is not None and champion.tokenizer_differs:
        why += (
            f"; the tokenizers differ ({champion.tokenizer_differs}): the champion has no "
            "eval_loss or perplexity on the candidate's tokens, and bits_per_byte (each model "
            "on its own tokenization of the same texts) compares them"
        )
    note = f'<p class="note">{_e(why[:1].upper() + why[1:])}; the gate metric is highlighted.</p>'

    return f'<table class="metrics">{head}{"".join(rows)}</table>{note}'


def _order(name: str) -> int:
    return METRIC_ORDER.index(name) if name in METRIC_ORDER else len(METRIC_ORDER)


def _value_cell(value: float | None) -> str:
    if value is None:
        return '<td class="none" title="not measured on this data">—</td>'
    return f"<td>{_e(_num(value))}</td>"


def _delta_cell(name: str, mine: float | None, theirs: float | None) -> str:
    if mine is None or theirs is None:
        return '<td class="none">—</td>'
    delta = float(mine) - float(theirs)
    if not math.isfinite(delta):
        return '<td class="none">—</td>'
    shown = "0" if delta == 0 else f"{delta:+.4g}"
    if name not in HIGHER_IS_BETTER or delta == 0:
        return f"<td>{shown}</td>"
    better = (delta > 0) == HIGHER_IS_BETTER[name]
    word = "better" if better else "worse"
    return f'<td class="{word}">{shown} ({word})</td>'


def _samples_table(samples: Sequence[Sample], champion: Champion | None, total: int | None) -> str:
    if not samples:
        return (
            '<p class="empty">No generations: the evaluation data has no prompt/answer '
            "examples (plain text is measured by loss and perplexity only).</p>"
        )
    with_champion = champion is not None
    head = "<tr><th>prompt</th><th>expected</th><th>candidate</th>"
    head += f"<th>champion v{_e(champion.version)}</th></tr>" if champion else "</tr>"
    rows = []
    for s in samples:
        cells = [_text_cell(s.prompt), _text_cell(s.expected), _answer_cell(s.candidate, s)]
        if with_champion:
            cells.append(
                _answer_cell(s.champion, s) if s.champion is not None else _value_cell(None)
            )
        rows.append(f"<tr>{''.join(cells)}</tr>")
    of = f" of {total}" if total is not None else ""
    order = ", those where the models disagree first" if with_champion else ""
    note = (
        f'<p class="note">{len(samples)}{of} held-out examples{order}; ✓ matches the expected '
        "answer exactly.</p>"
    )
    return f'<table class="samples">{head}{"".join(rows)}</table>{note}'


def _answer_cell(answer: str, sample: Sample) -> str:
    ok = answer == sample.expected
    mark = '<span class="ok">✓</span> ' if ok else '<span class="miss">✗</span> '
    return _text_cell(answer, mark)


def _text_cell(text: str, prefix: str = "") -> str:
    shown = text if len(text) <= MAX_TEXT else text[:MAX_TEXT]
    more = (
        f'<span class="more">… ({len(text) - MAX_TEXT} more characters)</span>'
        if len(text) > MAX_TEXT
        else ""
    )
    return f'<td>{prefix}<span class="text">{_e(shown)}</span>{more}</td>'


def _num(value: Any) -> str:
    """A figure as people read it: integers without `.0`, other floats to 4 digits, NaN and
    infinities by name; anything else as its text."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "∞" if value > 0 else "−∞"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def _e(text: Any) -> str:
    return escape(str(text), quote=True)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1b1f24;
max-width:1100px}
h1{font-size:22px;margin:0 0 12px}h2{font-size:17px;margin:28px 0 8px}
table{border-collapse:collapse;margin:4px 0}
th,td{border:1px solid #d0d7de;padding:4px 10px;text-align:left;vertical-align:top}
table.metrics td,table.settings td{font-variant-numeric:tabular-nums;text-align:right}
table.about th,table.settings th{background:#f6f8fa;font-weight:600}
tr.gate-metric{background:#fff8c5}
.decision{border-radius:6px;padding:10px 16px;margin:12px 0}
.decision.promote{background:#dafbe1;border:1px solid #4ac26b}
.decision.reject{background:#ffebe9;border:1px solid #ff8182}
.badge{font-weight:700;font-size:18px;letter-spacing:.04em}
.promote .badge{color:#1a7f37}.reject .badge{color:#cf222e}
.reasons{margin:6px 0 0;padding-left:20px}
.reasons .mark{font-weight:700}.pass .mark{color:#1a7f37}.fail .mark{color:#cf222e}
td.better{color:#1a7f37}td.worse{color:#cf222e}.none{color:#6e7781}
.ok{color:#1a7f37;font-weight:700}.miss{color:#cf222e;font-weight:700}
table.samples td{max-width:320px}
.text{white-space:pre-wrap;overflow-wrap:anywhere;font-family:ui-monospace,Menlo,monospace;
font-size:13px}
.more{color:#6e7781;font-size:12px}
.note,figcaption,.empty{color:#57606a;font-size:13px}
footer{margin-top:32px;color:#8c959f;font-size:12px}
"""
