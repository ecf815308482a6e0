"""kubellm.evaluate.report: the HTML page read back with a parser, not by string search, so
that what a browser would show (elements, their text, the chart's coordinates) is asserted."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from html.parser import HTMLParser

import pytest

from kubellm.evaluate.gate import Champion, decide
from kubellm.evaluate.report import (
    MAX_TEXT,
    Sample,
    html_report,
    pair_samples,
    svg_line_chart,
)

VOID = {"meta", "br", "img", "hr", "input", "link"}
METRICS = {"exact_match": 0.5, "eval_loss": 1.1, "perplexity": math.exp(1.1), "eval_examples": 4}
CHAMPION = Champion("3", {"exact_match": 0.25, "eval_loss": 1.3, "perplexity": math.exp(1.3)})
LOSS = [(3.0, 5.2), (6.0, 4.1), (9.0, 3.3), (12.0, 3.4), (15.0, 2.0)]
HOSTILE = '<script>alert("x")</script>'


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)  # own text and children's, in order

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def all(self, tag: str) -> list[Node]:
        found = [self] if self.tag == tag else []
        for child in self.children:
            found += child.all(tag)
        return found

    def one(self, tag: str, cls: str | None = None) -> Node:
        found = [n for n in self.all(tag) if cls is None or cls in n.attrs.get("class", "")]
        assert len(found) == 1, f"{len(found)} <{tag} class={cls}>"
        return found[0]


class Tree(HTMLParser):
    """A DOM of the page: HTMLParser unescapes text and attributes as a browser does."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        done = self.stack.pop()
        self.stack[-1].parts.append(done.text)

    def handle_data(self, data: str) -> None:
        self.stack[-1].parts.append(data)


def parse(page: str) -> Node:
    tree = Tree()
    tree.feed(page)
    tree.close()
    assert tree.stack == [tree.root], "unclosed elements"
    return tree.root


def report(**changes: object) -> Node:
    args: dict[str, object] = {
        "candidate": METRICS,
        "champion": CHAMPION,
        "gate": decide(METRICS, CHAMPION, margin=0.1, guards={"eval_loss": 0.5}),
        "loss": LOSS,
        "samples": [Sample("abc?", "yes", "yes", "no")],
        "total_examples": 4,
    }
    return parse(html_report(**{**args, **changes}))  # type: ignore[arg-type]


def polyline(doc: Node) -> list[tuple[float, float]]:
    points = doc.one("polyline", "series").attrs["points"].split()
    return [(float(x), float(y)) for x, y in (p.split(",") for p in points)]


def test_the_loss_curve_has_one_point_per_step_in_step_order_and_loss_scale() -> None:
    doc = report()
    line = polyline(doc)
    assert len(line) == len(LOSS)
    xs, ys = [x for x, _ in line], [y for _, y in line]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    # equal steps apart on the data, equal apart on the page
    gaps = [b - a for a, b in itertools.pairwise(xs)]
    assert max(gaps) - min(gaps) < 0.02
    # SVG's y grows downwards: a higher loss is drawn higher up, in the same order
    for (_, va), (_, vb), ya, yb in zip(LOSS, LOSS[1:], ys, ys[1:], strict=False):
        assert (va > vb) == (ya < yb)
    assert len(doc.one("g", "markers").all("circle")) == len(LOSS)


def test_the_axes_carry_labels_and_round_tick_values_covering_the_data() -> None:
    svg = report().one("svg")
    assert svg.one("text", "x-label").text == "step"
    assert svg.one("text", "y-label").text == "loss"
    for group, values in (("x-ticks", [x for x, _ in LOSS]), ("y-ticks", [y for _, y in LOSS])):
        ticks = [float(t.text) for t in svg.one("g", group).all("text")]
        assert len(ticks) >= 3, group
        steps = {round(b - a, 9) for a, b in itertools.pairwise(ticks)}
        assert len(steps) == 1, (group, ticks)  # evenly spaced
        assert ticks[0] <= min(values) and ticks[-1] >= max(values), (group, ticks)


def test_user_text_is_escaped_never_markup() -> None:
    doc = report(
        samples=[Sample(HOSTILE, "a & b", '"><img src=x onerror=alert(1)>', HOSTILE)],
        about={"model": "<b>m</b>"},
        loss_name="loss<i>",
    )
    assert doc.all("script") == [] and doc.all("img") == [] and doc.all("i") == []
    cells = [td.text for td in doc.one("table", "samples").all("td")]
    assert HOSTILE in cells[0] and "a & b" in cells[1]
    assert '"><img src=x onerror=alert(1)>' in cells[2]
    assert doc.one("table", "about").one("td").text == "<b>m</b>"
    assert doc.one("text", "y-label").text == "loss<i>"


def test_with_a_champion_the_table_compares_both_on_each_metric() -> None:
    table = report().one("table", "metrics")
    header = [th.text for th in table.all("tr")[0].all("th")]
    assert header == ["metric", "candidate", "champion v3", "candidate − champion"]
    rows = {tr.all("th")[0].text: [td.text for td in tr.all("td")] for tr in table.all("tr")[1:]}
    assert rows["exact_match"] == ["0.5", "0.25", "+0.25 (better)"]
    assert rows["eval_loss"] == ["1.1", "1.3", "-0.2 (better)"]
    assert rows["eval_examples"][1] == "—"  # the champion's metrics lack it here
    gate_row = [tr for tr in table.all("tr") if tr.attrs.get("class") == "gate-metric"]
    assert [tr.all("th")[0].text for tr in gate_row] == ["exact_match"]


def test_without_a_champion_the_table_shows_the_candidate_and_says_why() -> None:
    doc = report(champion=None, gate=decide(METRICS, None), samples=[Sample("p", "a", "a")])
    table = doc.one("table", "metrics")
    header = [th.text for th in table.all("tr")[0].all("th")]
    assert header == ["metric", "candidate", "no champion yet"]
    assert "champion v" not in doc.text
    assert "against no champion yet" in doc.one("section", "decision").text
    samples_header = [th.text for th in doc.one("table", "samples").all("th")]
    assert samples_header == ["prompt", "expected", "candidate"]


@pytest.mark.parametrize("margin", [0.1, 0.5])  # promote, then reject on the margin
def test_the_decision_and_every_reason_of_the_gate_are_shown(margin: float) -> None:
    gate = decide(METRICS, CHAMPION, margin=margin, guards={"eval_loss": 0.5})
    assert len(gate.reasons) == 3
    section = report(gate=gate).one("section", "decision")
    assert section.attrs["class"] == f"decision {gate.decision}"
    assert section.one("span", "badge").text == gate.decision.upper()
    items = section.all("li")
    assert [li.text.split(" ", 2)[2] for li in items] == gate.reasons
    # each check is marked: a rejected run shows which one failed
    marks = [(li.attrs["class"], li.one("span", "mark").text) for li in items]
    beats = next(i for i, why in enumerate(gate.reasons) if "vs champion v3" in why)
    for i, (cls, mark) in enumerate(marks):
        failed = margin == 0.5 and i == beats
        assert (cls, mark) == (("fail", "\u2717 fail") if failed else ("pass", "\u2713 pass"))
    assert gate.passed == [cls == "pass" for cls, _ in marks]


def test_no_loss_history_is_said_in_words_not_drawn_as_empty_axes() -> None:
    doc = report(loss=[], no_loss="this pipeline run has no train stage run")
    assert doc.all("svg") == []
    said = doc.one("p", "empty").text
    assert "No training loss history: this pipeline run has no train stage run" in said
    nan = report(loss=[(1.0, math.nan), (2.0, math.inf)])
    assert nan.all("svg") == []
    assert "2 points of loss were logged, none of them a finite number" in nan.text


def test_non_finite_points_are_left_out_and_counted() -> None:
    doc = report(loss=[(1.0, 2.0), (2.0, math.nan), (3.0, math.inf), (4.0, 1.0)])
    assert len(polyline(doc)) == 2
    assert "2 points that are not finite numbers left out" in doc.one("figcaption").text


def test_a_single_point_is_drawn_inside_axes_around_it() -> None:
    doc = report(loss=[(30.0, 2.5)])
    [(x, y)] = polyline(doc)
    assert len(doc.one("g", "markers").all("circle")) == 1  # a one-point line shows nothing
    svg = doc.one("svg")
    x_ticks = [float(t.text) for t in svg.one("g", "x-ticks").all("text")]
    y_ticks = [float(t.text) for t in svg.one("g", "y-ticks").all("text")]
    assert x_ticks[0] < 30 < x_ticks[-1] and y_ticks[0] < 2.5 < y_ticks[-1]
    assert 72 < x < 624 and 12 < y < 252  # strictly inside the plot area


def test_a_step_logged_again_keeps_its_last_value() -> None:
    """A resumed run logs the steps after its checkpoint again."""
    doc = report(loss=[(1.0, 3.0), (2.0, 9.0), (2.0, 2.0), (3.0, 1.0)])
    line = polyline(doc)
    assert len(line) == 3
    assert line[0][1] < line[1][1] < line[2][1]  # 3 > 2 > 1: the 9 is gone
    assert "1 steps logged again" in doc.one("figcaption").text


def test_long_texts_are_cut_and_the_rest_counted() -> None:
    long = "x" * (MAX_TEXT + 250)
    doc = report(samples=[Sample(long, "yes", "yes" * 500, None)])
    first = doc.one("table", "samples").all("td")[0]
    assert first.one("span", "text").text == "x" * MAX_TEXT
    assert first.one("span", "more").text == "… (250 more characters)"
    assert long not in doc.text


def test_svg_line_chart_refuses_to_draw_nothing() -> None:
    with pytest.raises(ValueError, match="no finite points"):
        svg_line_chart([(1.0, math.nan)])
    svg = parse(svg_line_chart([(0, 1.0), (1, 0.5)], x_label="epoch", y_label="val"))
    assert svg.one("text", "x-label").text == "epoch"
    assert len(polyline(svg)) == 2


def test_pair_samples_joins_on_the_example_and_puts_disagreements_first() -> None:
    mine = [
        {"prompt": "a?", "completion": "yes", "prediction": "yes"},
        {"prompt": "b?", "completion": "yes", "prediction": "no"},
        {"prompt": "c?", "completion": "no", "prediction": "no"},
    ]
    theirs = [  # another order, one example missing
        {"prompt": "c?", "completion": "no", "prediction": "no"},
        {"prompt": "b?", "completion": "yes", "prediction": "yes"},
    ]
    paired = pair_samples(mine, theirs)
    assert [(s.prompt, s.candidate, s.champion) for s in paired] == [
        ("b?", "no", "yes"),  # the models disagree
        ("a?", "yes", None),  # the champion was not asked
        ("c?", "no", "no"),
    ]
    assert [s.champion for s in pair_samples(mine, None)] == [None, None, None]
    assert len(pair_samples(mine * 10, None, limit=4)) == 4
