"""tests/fakes/UPSTREAM.md is the list of rules the fakes encode; this keeps it true.

Every row of every table under the header `| Behaviour | Upstream | Fake | Test | Fidelity |`
must cite an upstream repository, a path with a line (`#L12` or `#L12-L20`) and a tag or
commit (`@v1.2.3`); name a file under tests/fakes and, when it names them, functions or
`Class.method`s defined there; name a test function that exists (`tests/<path>.py::name` or
`::Class::name`, found with ast, not grep); and say how faithful the fake is (`same`, or
`stricter`/`lenient`/`simplified` followed by `:` and the reason). Every fake module has rows,
except the plumbing in NO_RULES and, until the lead merges tests/fakes/upstream.d/, PENDING.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKES = ROOT / "tests" / "fakes"
TABLE = FAKES / "UPSTREAM.md"
HEADER = ("Behaviour", "Upstream", "Fake", "Test", "Fidelity")

# Modules that encode no upstream rule (plumbing only), and why.
NO_RULES = {
    "http_fake.py": "the loopback HTTP server every fake runs on: no upstream behaviour",
    "sim_cluster.py": "wires the fake API server and the controllers together",
}
# TEMPORARY: modules whose rows other slices write in tests/fakes/upstream.d/<slice>.md and the
# lead pastes into UPSTREAM.md at merge. The lead EMPTIES this set then, so that every one of
# these modules must have its rows (a module listed here that already has rows is fine).
PENDING: set[str] = set()  # every module's rows are merged

_UPSTREAM = re.compile(
    r"^`(?P<repo>[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)`\s+"
    r"`(?P<path>[^`#\s]+)#L(?P<start>\d+)(?:-L(?P<end>\d+))?`\s+"
    r"`@(?P<ref>[A-Za-z0-9_./+-]+)`$"
)
# the file, then any names in it (separated by spaces or commas)
_FAKE = re.compile(r"^`(?P<file>tests/fakes/[A-Za-z0-9_]+\.py)`(?P<names>(?:,?\s+`[^`]+`)*)$")
_TEST = re.compile(r"^`(?P<file>tests/[A-Za-z0-9_/]+\.py)::(?P<name>[A-Za-z0-9_:]+)`$")
# `same` may carry a note after `;` or in parentheses; the others need `: <why>`
_FIDELITY = re.compile(
    r"^(?P<kind>same|stricter|lenient|simplified)(?::\s*(?P<why>.*)|\s*[;(].*)?$"
)


@dataclass(frozen=True)
class Row:
    line: int
    behaviour: str
    upstream: str
    fake: str
    test: str
    fidelity: str

    @property
    def id(self) -> str:
        module = re.search(r"tests/fakes/(\w+)\.py", self.fake)
        slug = re.sub(r"[^a-z0-9]+", "-", self.behaviour.lower()).strip("-")[:48]
        return f"L{self.line}-{module[1] if module else 'nofake'}-{slug}"


def _cells(line: str) -> list[str]:
    inner = line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]
    return [c.strip() for c in inner.split("|")]


def parse(text: str) -> list[Row]:
    """The rows of every table whose header is HEADER (the separator line skipped)."""
    rows: list[Row] = []
    in_table = False
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if tuple(cells) == HEADER:
            in_table = True
            continue
        if not in_table or all(set(c) <= set("-: ") for c in cells):
            continue
        if len(cells) != len(HEADER):
            rows.append(Row(number, f"<{len(cells)} cells>", "", "", "", ""))
            continue
        rows.append(Row(number, *cells))
    return rows


ROWS = parse(TABLE.read_text())


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _defined(path: Path) -> set[str]:
    """Top-level functions, classes and assigned names, and `Class.method` for methods."""
    names: set[str] = set()
    for node in _tree(path).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}.{item.name}")
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _tests(path: Path) -> set[str]:
    """`name` for module-level test functions and `Class::name` for test methods."""
    found: set[str] = set()
    for node in _tree(path).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name.startswith("test"):
                found.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                is_function = isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                if is_function and item.name.startswith("test"):
                    found.add(f"{node.name}::{item.name}")
    return found


def test_the_table_has_rows() -> None:
    assert len(ROWS) >= 50, f"{TABLE}: only {len(ROWS)} rows under {' | '.join(HEADER)}"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_row(row: Row) -> None:
    where = f"{TABLE.name} line {row.line}"
    assert row.behaviour and not row.behaviour.startswith("<"), f"{where}: not 5 cells"

    up = _UPSTREAM.match(row.upstream)
    assert up, (
        f"{where}: Upstream must be `owner/repo` `path#L<n>[-L<m>]` `@tag-or-commit`, "
        f"got {row.upstream!r}"
    )
    if up["end"]:
        assert int(up["start"]) <= int(up["end"]), f"{where}: line range {row.upstream}"

    fake = _FAKE.match(row.fake)
    assert fake, f"{where}: Fake must be `tests/fakes/<module>.py` [`name`], got {row.fake!r}"
    fake_file = ROOT / fake["file"]
    assert fake_file.is_file(), f"{where}: {fake['file']} does not exist"
    defined = _defined(fake_file)
    for name in re.findall(r"`([^`]+)`", fake["names"]):
        assert name in defined, f"{where}: {name} is not defined in {fake['file']}"

    test = _TEST.match(row.test)
    assert test, f"{where}: Test must be `tests/<path>.py::<name>`, got {row.test!r}"
    test_file = ROOT / test["file"]
    assert test_file.is_file(), f"{where}: {test['file']} does not exist"
    assert test["name"] in _tests(test_file), (
        f"{where}: no test function {test['name']} in {test['file']}"
    )

    fidelity = _FIDELITY.match(row.fidelity)
    assert fidelity, (
        f"{where}: Fidelity must start with same, stricter, lenient or simplified, "
        f"got {row.fidelity!r}"
    )
    if fidelity["kind"] != "same":
        assert (fidelity["why"] or "").strip(), (
            f"{where}: {fidelity['kind']} needs `: <why>` (what differs and why)"
        )


def test_every_fake_module_has_rows() -> None:
    covered = {Path(m).name for r in ROWS for m in re.findall(r"tests/fakes/\w+\.py", r.fake)}
    modules = {p.name for p in FAKES.glob("*.py") if p.name != "__init__.py"}
    missing = sorted(modules - covered - NO_RULES.keys() - PENDING)
    assert not missing, f"fake modules with no row in {TABLE.name}: {missing}"
    exempt_with_rows = sorted(covered & NO_RULES.keys())
    assert not exempt_with_rows, f"{exempt_with_rows} have rows: take them out of NO_RULES"


def test_the_parser_reads_rows_and_skips_other_tables() -> None:
    text = (
        "| A | B |\n|---|---|\n| x | y |\n\n"
        "| Behaviour | Upstream | Fake | Test | Fidelity |\n|---|---|---|---|---|\n"
        "| b | `o/r` `p.go#L1` `@v1` | `tests/fakes/f.py` | `tests/t.py::test_x` | same |\n"
    )
    (row,) = parse(text)
    assert (row.line, row.behaviour, row.fidelity) == (7, "b", "same")
