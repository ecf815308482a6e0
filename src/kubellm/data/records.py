"""What every data step shares: a record, the counts, and how bad input is reported.

Nothing is dropped silently: each dropped record is counted under a reason, and under
`on_error="fail"` a bad-input reason stops the stage with an error naming the file and line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kubellm.config import OnError

__all__ = ["BAD_INPUT", "Counts", "DataError", "OnError", "Record", "TextBatch"]

# Reasons that mean the input itself is broken (strict mode stops on them); the others are
# filters (quality, length, duplicates) and always just count.
BAD_INPUT = frozenset(
    {
        "malformed_json",
        "missing_text",
        "invalid_utf8",
        "empty",
        "too_long",
        "unreadable_file",
        "empty_file",
        "bad_template",
    }
)


class DataError(ValueError):
    """Input that cannot become a dataset; the message names the file, line or filter."""


@dataclass
class Record:
    """One document: the training text, and its prompt/completion split when it has one.

    A chat rendered by its template (kubellm.data.templates) also has `segments`, the text in
    (piece, trainable) pieces (several trained turns), and `messages`, the chat itself; its
    prompt/completion split falls at the start of the last trained piece.
    """

    text: str
    where: str = ""  # "path:line" (or "path" for whole-file documents), for error messages
    prompt: str | None = None
    completion: str | None = None
    segments: tuple[tuple[str, bool], ...] | None = None
    messages: list[dict[str, str]] | None = None

    @property
    def is_pair(self) -> bool:
        return self.prompt is not None and self.completion is not None


@dataclass
class TextBatch:
    """Plain-text records read together (consecutive lines of one JSONL file, in order):
    the records `records()` makes, kept as columns so that per-record work can be done a
    batch at a time. `column` holds the same texts as an Arrow string array (valid UTF-8:
    no lone surrogates), `lines` each record's line number."""

    texts: list[str]
    column: Any  # pyarrow.StringArray, without nulls
    name: str  # the file, as `Record.where` names it
    lines: Sequence[int]

    def where(self, i: int) -> str:
        return f"{self.name}:{self.lines[i]}"

    def records(self) -> list[Record]:
        return [Record(t, self.where(i)) for i, t in enumerate(self.texts)]


@dataclass
class Counts:
    """read = kept + sum(dropped), always; `assert_reconciled` checks it."""

    read: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    def drop(self, reason: str, where: str, on_error: OnError, detail: str = "") -> None:
        """Count one dropped record, or raise when strict mode forbids this reason."""
        if on_error == "fail" and reason in BAD_INPUT:
            text = reason.replace("_", " ")
            raise DataError(f"{where}: {text}{': ' + detail if detail else ''}")
        self.dropped[reason] += 1

    def summary(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.dropped.most_common()) or "none"

    def assert_reconciled(self) -> None:
        if self.read != self.kept + sum(self.dropped.values()):
            raise AssertionError(
                f"counts do not reconcile: read {self.read} != kept {self.kept} + dropped "
                f"{sum(self.dropped.values())} ({self.summary()})"
            )
