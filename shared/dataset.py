"""Reading training records. Torch-free, so the API can check a dataset at submit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# How many bad lines one error message names before it says "and N more".
MAX_REPORTED_PROBLEMS = 5


@dataclass(frozen=True)
class RecordProblem:
    line: int
    message: str


class DatasetError(ValueError):
    """The dataset cannot be trained on. ``str()`` is a message a user can act on."""

    def __init__(self, message: str, problems: list[RecordProblem] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


def iter_text_records(path: Path) -> Iterator[tuple[int, str | RecordProblem]]:
    """Yield ``(line number, text)`` per JSONL record, or a problem for a malformed line."""
    with path.open("r", encoding="utf-8", errors="strict") as f:
        lineno = 0
        while True:
            lineno += 1
            try:
                raw = f.readline()
            except UnicodeDecodeError:
                yield lineno, RecordProblem(lineno, "is not valid UTF-8")
                return
            if not raw:
                return
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                yield lineno, RecordProblem(lineno, f"is not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(record, dict):
                yield lineno, RecordProblem(lineno, 'must be a JSON object like {"text": "..."}')
            elif "text" not in record:
                yield lineno, RecordProblem(lineno, 'has no "text" field')
            elif not isinstance(record["text"], str):
                yield lineno, RecordProblem(lineno, 'field "text" must be a string')
            elif not record["text"].strip():
                yield lineno, RecordProblem(lineno, 'field "text" is empty')
            else:
                yield lineno, record["text"]


def read_text_records(path: Path) -> list[str]:
    """All texts of a JSON Lines file with a ``text`` field, or a DatasetError naming bad lines."""
    texts: list[str] = []
    problems: list[RecordProblem] = []
    for _, item in iter_text_records(path):
        if isinstance(item, RecordProblem):
            problems.append(item)
        else:
            texts.append(item)
    if problems:
        shown = "; ".join(f"line {p.line} {p.message}" for p in problems[:MAX_REPORTED_PROBLEMS])
        more = len(problems) - MAX_REPORTED_PROBLEMS
        suffix = f"; and {more} more bad lines" if more > 0 else ""
        raise DatasetError(f"{path.name}: {shown}{suffix}", problems)
    if not texts:
        raise DatasetError(f'{path.name} has no records: add JSON Lines like {{"text": "..."}}')
    return texts
