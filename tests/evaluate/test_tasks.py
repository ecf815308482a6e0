"""evaluate.tasks: a user's JSONL of prompt/answer pairs, read strictly."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from kubellm.data.records import DataError
from kubellm.evaluate.tasks import load_task


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_prompt_answer_pairs_under_their_usual_names(tmp_path: Path) -> None:
    task = _write(
        tmp_path / "task.jsonl",
        [
            json.dumps({"prompt": "2+2=", "completion": "4"}),
            "",
            json.dumps({"question": "capital of France?", "answer": "Paris", "id": 7}),
            json.dumps({"input": "hi", "output": "hello"}),
        ],
    )
    assert load_task(str(task)) == [
        {"prompt": "2+2=", "completion": "4"},
        {"prompt": "capital of France?", "completion": "Paris"},
        {"prompt": "hi", "completion": "hello"},
    ]
    assert len(load_task(str(task), limit=2)) == 2


def test_a_compressed_file_by_uri(tmp_path: Path) -> None:
    path = tmp_path / "task.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    assert load_task(path.as_uri()) == [{"prompt": "a", "completion": "b"}]


@dataclass
class Bad:
    name: str
    line: str
    error: str


BAD = [
    Bad("not json", "{nope", r"task.jsonl:2: not JSON"),
    Bad("a list", "[1, 2]", r"task.jsonl:2: a JSON list, not an object"),
    Bad("no answer", '{"prompt": "x"}', r"task.jsonl:2: no 'completion' / 'answer'"),
    Bad("no prompt", '{"answer": "x"}', r"task.jsonl:2: no 'prompt' / 'question'"),
    Bad("number answer", '{"prompt": "x", "answer": 4}', r"field 'answer' is int, not a string"),
    Bad("empty prompt", '{"prompt": "", "answer": "4"}', r"task.jsonl:2: the prompt is empty"),
]


@pytest.mark.parametrize("case", BAD, ids=[c.name for c in BAD])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path: Path, case: Bad) -> None:
    task = _write(tmp_path / "task.jsonl", [json.dumps({"prompt": "1", "answer": "1"}), case.line])
    with pytest.raises(DataError, match=case.error):
        load_task(str(task))


def test_a_missing_or_empty_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"eval_data .*missing\.jsonl does not exist"):
        load_task(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="has no prompt/answer records"):
        load_task(str(_write(tmp_path / "empty.jsonl", [""])))
