"""Reading and checking training records. Torch-free, so the API can check a dataset at submit.

Three record formats, told apart by their fields (or named by ``training.dataset_format``):

- ``text``: ``{"text": "..."}``, causal LM on the whole text;
- ``prompt_completion``: ``{"prompt": "...", "completion": "..."}``, loss on the completion;
- ``messages``: ``{"messages": [{"role": "user", "content": "..."}, ...]}``, rendered with
  the tokenizer's chat template, loss on the assistant turns.

Files are JSON Lines (read here, so a bad line is named by its number), or JSON, CSV and
Parquet (read with the ``datasets`` library, a bad record named by its row).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

DatasetFormat = Literal["text", "prompt_completion", "messages"]
FORMATS: tuple[str, ...] = get_args(DatasetFormat)
ROLES = ("system", "user", "assistant", "tool")
# File types by extension. Anything else is read as JSON Lines, the documented default.
JSON_LINES, JSON_FILE, CSV, PARQUET = "jsonl", "json", "csv", "parquet"
FILE_TYPES = {".jsonl": JSON_LINES, ".ndjson": JSON_LINES, ".json": JSON_FILE, ".csv": CSV, ".parquet": PARQUET}

# How many bad records one error message names before it says "and N more".
MAX_REPORTED_PROBLEMS = 5
EXAMPLES: dict[str, str] = {
    "text": '{"text": "..."}',
    "prompt_completion": '{"prompt": "...", "completion": "..."}',
    "messages": '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}',
}


@dataclass(frozen=True)
class RecordProblem:
    where: str  # "line 3" (JSON Lines), "record 3" (JSON), "row 3" (CSV, Parquet)
    message: str

    @property
    def line(self) -> int:
        return int(self.where.rsplit(" ", 1)[1])


class DatasetError(ValueError):
    """The dataset cannot be trained on. ``str()`` is a message a user can act on."""

    def __init__(self, message: str, problems: list[RecordProblem] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


@dataclass
class Records:
    """A dataset's records in one format, each with where it came from."""

    format: DatasetFormat
    rows: list[dict[str, Any]] = field(default_factory=list)
    where: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)


def file_type(path: Path) -> str:
    return FILE_TYPES.get(path.suffix.lower(), JSON_LINES)


def iter_json_lines(path: Path) -> Iterator[tuple[str, Any | RecordProblem]]:
    """Yield ``("line N", value)`` per non-blank line, or a problem for a malformed one."""
    with path.open("r", encoding="utf-8", errors="strict") as f:
        lineno = 0
        while True:
            lineno += 1
            where = f"line {lineno}"
            try:
                raw = f.readline()
            except UnicodeDecodeError:
                yield where, RecordProblem(where, "is not valid UTF-8")
                return
            if not raw:
                return
            if not raw.strip():
                continue
            try:
                yield where, json.loads(raw)
            except json.JSONDecodeError as e:
                yield where, RecordProblem(where, f"is not valid JSON ({e.msg} at column {e.colno})")


def iter_table(path: Path, kind: str) -> Iterator[tuple[str, Any | RecordProblem]]:
    """JSON, CSV and Parquet through ``datasets``: ``("row N", record)``, 1-based."""
    import datasets

    datasets.disable_progress_bars()
    readers = {JSON_FILE: datasets.Dataset.from_json, CSV: datasets.Dataset.from_csv}
    read = readers.get(kind, datasets.Dataset.from_parquet)
    label = "record" if kind == JSON_FILE else "row"
    # A throwaway cache: the records are read once here and tokenized (and cached) later.
    with tempfile.TemporaryDirectory(prefix="tuneq-read-") as cache_dir:
        try:
            table = read(str(path), keep_in_memory=True, cache_dir=cache_dir)
        except Exception as e:  # pyarrow and pandas raise many types; all mean "cannot parse"
            raise DatasetError(f"{path.name} cannot be read as {kind.upper()}: {_first_line(e)}") from None
        assert isinstance(table, datasets.Dataset)
        for index, record in enumerate(table, start=1):
            yield f"{label} {index}", record


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def detect_format(record: Any) -> DatasetFormat | None:
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def _string_field(record: dict[str, Any], name: str, *, may_be_empty: bool = False) -> str | None:
    """None when the field is fine, else what is wrong with it."""
    if name not in record or record[name] is None:
        return f'has no "{name}" field'
    if not isinstance(record[name], str):
        return f'field "{name}" must be a string'
    if not may_be_empty and not record[name].strip():
        return f'field "{name}" is empty'
    return None


def _messages_problem(record: dict[str, Any]) -> str | None:
    messages = record.get("messages")
    if isinstance(messages, str):  # CSV cells hold JSON text
        try:
            messages = record["messages"] = json.loads(messages)
        except json.JSONDecodeError:
            return 'field "messages" must be a list of {"role", "content"} objects'
    if not isinstance(messages, list) or not messages:
        return 'field "messages" must be a non-empty list of {"role", "content"} objects'
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"field messages[{i}] must be an object with role and content"
        if message.get("role") not in ROLES:
            return f"field messages[{i}].role must be one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"field messages[{i}].content must be a string"
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return 'has no non-empty "assistant" message to train on'
    return None


def record_problem(record: Any, dataset_format: DatasetFormat) -> str | None:
    """What is wrong with one record for the given format, or None."""
    if not isinstance(record, dict):
        return f"must be a JSON object like {EXAMPLES[dataset_format]}"
    if dataset_format == "text":
        return _string_field(record, "text")
    if dataset_format == "prompt_completion":
        return _string_field(record, "prompt", may_be_empty=True) or _string_field(record, "completion")
    return _messages_problem(record)


def detect_file_format(path: Path) -> DatasetFormat:
    """The format of a dataset file, from its first record that is an object with known fields."""
    kind = file_type(path)
    for _, item in iter_json_lines(path) if kind == JSON_LINES else iter_table(path, kind):
        found = None if isinstance(item, RecordProblem) else detect_format(item)
        if found is not None:
            return found
    return read_records(path).format  # raises the DatasetError that says what is wrong


def read_records(path: Path, *, dataset_format: DatasetFormat | None = None) -> Records:
    """Every record of a dataset file in one format, or a DatasetError naming the bad ones.

    Without ``dataset_format`` the format is the first record's (by its fields); every
    other record must then have the same fields.
    """
    kind = file_type(path)
    items = iter_json_lines(path) if kind == JSON_LINES else iter_table(path, kind)
    records: Records | None = None
    problems: list[RecordProblem] = []
    for where, item in items:
        if isinstance(item, RecordProblem):
            problems.append(item)
            continue
        if records is None:
            chosen = dataset_format or detect_format(item)
            if chosen is None:
                problems.append(
                    RecordProblem(
                        where,
                        "has none of the fields of a known format: use "
                        + ", or ".join(EXAMPLES.values())
                        + " (or set training.dataset_format)",
                    )
                )
                continue
            records = Records(format=chosen)
        problem = record_problem(item, records.format)
        if problem is not None:
            problems.append(RecordProblem(where, problem))
        elif not problems:  # once a record is bad, keep reading only to report problems
            records.rows.append(item)
            records.where.append(where)
    if problems:
        shown = "; ".join(f"{p.where} {p.message}" for p in problems[:MAX_REPORTED_PROBLEMS])
        more = len(problems) - MAX_REPORTED_PROBLEMS
        suffix = f"; and {more} more bad records" if more > 0 else ""
        raise DatasetError(f"{path.name}: {shown}{suffix}", problems)
    if records is None or not records.rows:
        raise DatasetError(f"{path.name} has no records: add records like {EXAMPLES['text']}")
    return records
