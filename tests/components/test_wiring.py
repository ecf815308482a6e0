"""Components are wiring: a few lines that call one stage (issue 8's budget: 20 lines of body,
not counting the parameter declarations). Logic inside a `@dsl.component` body can only be
tested through KFP, so it belongs in kubellm.stages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

COMPONENTS = sorted((Path(__file__).resolve().parents[2] / "components").glob("[!_]*.py"))
MAX_BODY_LINES = 20


def _component(path: Path) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    found = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("component" in ast.unparse(d) for d in node.decorator_list)
    ]
    assert len(found) == 1, f"{path.name}: expected one @dsl.component, found {len(found)}"
    return found[0]


def body_lines(path: Path) -> int:
    """Non-blank, non-comment source lines of the body, docstring excluded."""
    fn = _component(path)
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = path.read_text().splitlines()[body[0].lineno - 1 : fn.end_lineno]
    return sum(1 for ln in lines if ln.strip() and not ln.strip().startswith("#"))


def test_every_stage_has_a_component() -> None:
    names = {p.stem for p in COMPONENTS}
    stages = {p.stem for p in (COMPONENTS[0].parents[1] / "src/kubellm/stages").glob("*.py")}
    assert names == stages - {"__init__", "context", "configs"}


@pytest.mark.parametrize("path", COMPONENTS, ids=lambda p: p.stem)
def test_component_is_a_few_lines_that_call_its_stage(path: Path) -> None:
    n = body_lines(path)
    assert n <= MAX_BODY_LINES, f"{path.name}: {n} lines of body (budget {MAX_BODY_LINES})"
    source = ast.unparse(_component(path))
    assert f"from kubellm.stages import {path.stem}" in source
    assert f"{path.stem}.run(" in source


def test_the_line_count_sees_added_logic(tmp_path: Path) -> None:
    padded = tmp_path / "padded.py"
    text = COMPONENTS[0].read_text()
    extra = "".join(f"    x{i} = {i}\n" for i in range(MAX_BODY_LINES))
    padded.write_text(text.rstrip("\n") + "\n" + extra)
    assert body_lines(padded) == body_lines(COMPONENTS[0]) + MAX_BODY_LINES
