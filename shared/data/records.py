"""Reading and checking training records. Torch-free, so the API can check a dataset at submit.

Three record formats for supervised fine-tuning (SFT), told apart by their fields (or named by
``training.dataset_format``):

- ``text``: ``{"text": "..."}``, causal LM on the whole text;
- ``prompt_completion``: ``{"prompt": "...", "completion": "..."}``, loss on the completion;
- ``messages``: OpenAI's chat fine-tuning format, ``{"messages": [{"role": "user", "content":
  "..."}, ...], "tools": [...]}``, rendered with the tokenizer's chat template, loss on the
  assistant turns: roles ``system``, ``developer`` (OpenAI's newer name for ``system``), ``user``,
  ``assistant`` and ``tool``; assistant ``tool_calls`` (with ``content: null``); an assistant's
  ``weight`` (0: not trained on); a top-level ``tools`` list.

A fourth, ``preference``, is pairs of answers to one prompt for preference tuning (DPO), told
apart by their answers' fields (``chosen``/``rejected``, ``preferred_output``/
``non_preferred_output``) and read by ``shared.data.preference``. An SFT job refuses such a file
whole, with one message naming the method (``preference_refusal``), never line by line; a DPO job
refuses a file of SFT records the same way (``preference.supervised_refusal``).

Files uploaded through the OpenAI-compatible ``POST /v1/files`` are checked by the same rules
(``check_openai_chat_file``, which phrases problems as that API does; OpenAI's DPO records by
``shared.data.preference``'s, ``shared.data.uploaded_files`` choosing), so an uploaded file and a
dataset given to ``POST /jobs`` are read, checked and trained the same way.

Files are JSON Lines (read here, so a bad line is named by its number), or JSON, CSV and
Parquet (read with the ``datasets`` library, a bad record named by its row). A JSON Lines file is
read a line at a time, and a line past ``max_line_bytes`` (``TUNEQ_MAX_LINE_BYTES``) is refused
without ever being held whole: a file's size bounds disk, this bounds memory. Every record, of
every file type, then gets the limits a request body gets (``shared.json_values``: nesting, NUL,
lone surrogates) before any format's checks: such a record would fail a tokenizer mid-run.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, get_args

from shared.json_values import MAX_DEPTH, Loc, ValueProblem, value_problem

# What a supervised fine-tuning job trains on: ``training.dataset_format`` takes these only.
SftFormat = Literal["text", "prompt_completion", "messages"]
DatasetFormat = Literal[SftFormat, "preference"]
FORMATS: tuple[str, ...] = get_args(DatasetFormat)
# A preference record's answers, by which it is told from the SFT formats: TRL's and OpenAI's.
PREFERENCE_ANSWER_FIELDS = ("chosen", "rejected", "preferred_output", "non_preferred_output")
# OpenAI's chat roles: ``developer`` is its newer name for ``system`` (rendered as ``system``).
ROLES = ("system", "developer", "user", "assistant", "tool")
# File types by extension. Anything else is read as JSON Lines, the documented default.
JSON_LINES, JSON_FILE, CSV, PARQUET = "jsonl", "json", "csv", "parquet"
FILE_TYPES = {".jsonl": JSON_LINES, ".ndjson": JSON_LINES, ".json": JSON_FILE, ".csv": CSV, ".parquet": PARQUET}
# A CSV cell holds text, so these columns of a CSV file hold JSON text (never plain text: a
# TRL ``chosen`` cell may be either, so it stays text).
JSON_TEXT_COLUMNS = ("messages", "tools", "input", "preferred_output", "non_preferred_output")

# How many bad records one error message names before it says "and N more".
MAX_REPORTED_PROBLEMS = 5
TOO_DEEP = f"is nested deeper than {MAX_DEPTH} levels, which no record needs: flatten it"
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


@dataclass(frozen=True)
class FieldProblem:
    """What is wrong with one field of a record: ``field`` is its path in the record
    (``messages``, ``messages[1].role``), None when the problem is the record as a whole."""

    field: str | None
    message: str

    def native_text(self) -> str:
        """As the native formats phrase it after "line N": ``field "messages" must be ...``
        (a top-level name quoted, as ``string_field_problem`` quotes it), ``field messages[1].role ...``."""
        if self.field is None:
            return self.message
        name = f'"{self.field}"' if self.field.isidentifier() else self.field
        return f"field {name} {self.message}"

    def sentence(self, where: str) -> str:
        """As the OpenAI-compatible API phrases it: ``line 7: messages[1].role must be ...``."""
        return f"{where}: {self.field} {self.message}" if self.field else f"{where}: the record {self.message}"


class DatasetError(ValueError):
    """The dataset cannot be trained on. ``str()`` is a message a user can act on."""

    def __init__(self, message: str, problems: list[RecordProblem] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


@dataclass
class Records:
    """A dataset's records in one SFT format, each with where it came from."""

    format: SftFormat
    rows: list[dict[str, Any]] = field(default_factory=list)
    where: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)


def file_type(path: Path) -> str:
    return FILE_TYPES.get(path.suffix.lower(), JSON_LINES)


def iter_json_lines(path: Path, *, max_line_bytes: int) -> Iterator[tuple[str, Any | FieldProblem]]:
    """Yield ``("line N", value)`` per non-blank line, or a problem for a malformed one.

    A line of more than ``max_line_bytes`` bytes (its newline aside) is a problem, read past in
    pieces of at most that size: never held whole, however long.
    """
    with path.open("rb") as f:
        lineno = 0
        while raw := f.readline(max_line_bytes + 1):
            lineno += 1
            where = f"line {lineno}"
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                _skip_rest_of_line(f, max_line_bytes + 1)
                yield where, FieldProblem(None, _too_long(max_line_bytes))
            elif raw.strip():
                yield where, _parsed_line(raw)


def _too_long(max_line_bytes: int) -> str:
    return (
        f"is longer than {max_line_bytes} bytes, the most one line may hold (TUNEQ_MAX_LINE_BYTES): "
        "shorten the record, or split it into several"
    )


def _skip_rest_of_line(f: BinaryIO, piece_bytes: int) -> None:
    while (piece := f.readline(piece_bytes)) and not piece.endswith(b"\n"):
        pass


def _parsed_line(raw: bytes) -> Any | FieldProblem:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return FieldProblem(None, "is not valid UTF-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return FieldProblem(None, f"is not valid JSON ({e.msg} at column {e.colno})")
    except RecursionError:  # Python's parser recurses per level, so it gives up near a thousand
        return FieldProblem(None, TOO_DEEP)


def iter_table(path: Path, kind: str) -> Iterator[tuple[str, Any | FieldProblem]]:
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
            try:
                record = _without_nulls(record)
                if kind == CSV:
                    _decode_json_text(record)
            except RecursionError:  # a column nested about a thousand deep, or a cell's JSON text
                yield f"{label} {index}", FieldProblem(None, TOO_DEEP)
                continue
            yield f"{label} {index}", record


def iter_records(
    path: Path, *, max_line_bytes: int, kind: str | None = None
) -> Iterator[tuple[str, Any | FieldProblem]]:
    """Every record of a file of ``kind`` (by default its extension's), as ``(where, record)``,
    or the problem that keeps it from being one: unreadable, not JSON, too long a line, or a
    value ``shared.json_values`` refuses (the one check of every string of every record)."""
    kind = kind or file_type(path)
    items = iter_json_lines(path, max_line_bytes=max_line_bytes) if kind == JSON_LINES else iter_table(path, kind)
    for where, item in items:
        if not isinstance(item, FieldProblem) and (found := value_problem(item)) is not None:
            item = _field_problem_of(found)
        yield where, item


def _field_problem_of(found: ValueProblem) -> FieldProblem:
    """A refused value as a problem of the field it is in: a string or key by its own path
    (``messages[1].content``), nesting by the top-level field it is under."""
    if found.kind == "too_deep":
        top = found.loc[0] if found.loc else None
        return FieldProblem(top if isinstance(top, str) else None, TOO_DEEP)
    return FieldProblem(_field_path(found.loc) or None, found.message)


def _field_path(loc: Loc) -> str:
    """Keys and indexes as a record's fields are named: ``messages[1].tool_calls[0].id``."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _without_nulls(value: Any) -> Any:
    """``value`` with every null-valued key left out, at every depth.

    A table gives every record every field any record has: Arrow fills the ones a record lacks
    (a message's ``tool_calls``, a tool schema's other properties) with nulls, which would
    otherwise read as fields given as null and reach the chat template.
    """
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _decode_json_text(record: dict[str, Any]) -> None:
    """A CSV row's ``messages``, ``tools`` (and OpenAI DPO) cells as the JSON their text holds.
    Text that is not JSON stays text, and the record check says the field must be a list."""
    for column in JSON_TEXT_COLUMNS:
        if isinstance(record.get(column), str):
            with contextlib.suppress(json.JSONDecodeError):
                record[column] = json.loads(record[column])


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def detect_format(record: Any) -> DatasetFormat | None:
    if not isinstance(record, dict):
        return None
    # First: no SFT record needs an answer pair's fields, and a preference record may carry a
    # ``prompt`` (TRL's) or ``messages``-like columns beside them.
    if any(name in record for name in PREFERENCE_ANSWER_FIELDS):
        return "preference"
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def string_field_problem(record: dict[str, Any], name: str, *, may_be_empty: bool = False) -> FieldProblem | None:
    """What is wrong with a record's text field ``name``, or None."""
    if name not in record or record[name] is None:
        return FieldProblem(None, f'has no "{name}" field')
    if not isinstance(record[name], str):
        return FieldProblem(name, "must be a string")
    if not may_be_empty and not record[name].strip():
        return FieldProblem(name, "is empty")
    return None


def _chat_problem(record: dict[str, Any]) -> FieldProblem | None:
    """The first problem of a chat record (OpenAI's chat fine-tuning format): its messages,
    their roles, assistant ``tool_calls`` and ``weight``, and the top-level ``tools``.

    The one rule set of both the native ``messages`` format and ``POST /v1/files``. A field
    given as null counts as absent, as transformers treats it when it renders a conversation.
    """
    messages: Any = record.get("messages")
    if (problem := messages_problem(messages, "messages")) is not None:
        return problem
    if not any(is_trained_turn(m) and answers_something(m) for m in messages):
        return FieldProblem(
            "messages", "has no assistant message to train on (with content or tool_calls, and weight 1)"
        )
    return tools_problem(record.get("tools"), "tools")


def messages_problem(messages: Any, at: str, *, first_index: int = 0) -> FieldProblem | None:
    """The first problem of a list of chat messages found at ``at`` (``messages``,
    ``input.messages``): a non-empty list, each message with a known role and its fields right.
    ``first_index``: the index of the first in the record's list, when these are a tail of it."""
    if not isinstance(messages, list) or not messages:
        return FieldProblem(at, 'must be a non-empty list of {"role", "content"} objects')
    for i, message in enumerate(messages, start=first_index):
        here = f"{at}[{i}]"
        if not isinstance(message, dict):
            return FieldProblem(here, "must be an object with role and content")
        if message.get("role") not in ROLES:
            return FieldProblem(f"{here}.role", f"must be one of {', '.join(ROLES)}")
        if (problem := _message_problem(message, here)) is not None:
            return problem
    return None


def is_trained_turn(message: dict[str, Any]) -> bool:
    """Whether the loss covers this message: an assistant turn without ``weight: 0``."""
    return message.get("role") == "assistant" and message.get("weight") != 0


def answers_something(message: dict[str, Any]) -> bool:
    """Whether an assistant message holds an answer: content that is not blank, or tool calls."""
    content = message.get("content")
    return (isinstance(content, str) and bool(content.strip())) or bool(message.get("tool_calls"))


def _string_or_absent(item: dict[str, Any], name: str, at: str) -> FieldProblem | None:
    """An optional string field of ``item`` (found at ``at``): absent (or null), or a string."""
    if item.get(name) is not None and not isinstance(item[name], str):
        return FieldProblem(f"{at}.{name}", "must be a string")
    return None


def _message_problem(message: dict[str, Any], at: str) -> FieldProblem | None:
    """One message, its role already checked."""
    assistant = message["role"] == "assistant"
    tool_calls = message.get("tool_calls")
    content = message.get("content")
    if not assistant:
        for only_assistant in ("tool_calls", "weight"):
            if message.get(only_assistant) is not None:
                return FieldProblem(f"{at}.{only_assistant}", "is only allowed on assistant messages")
    if tool_calls is not None and (problem := _tool_calls_problem(tool_calls, f"{at}.tool_calls")):
        return problem
    if not isinstance(content, str) and not (assistant and content is None and tool_calls):
        # Content parts (lists of text or images) are OpenAI's vision fine-tuning; not trained here.
        need = "a string, or null on an assistant message with tool_calls" if assistant else "a string"
        return FieldProblem(f"{at}.content", f"must be {need}")
    weight = message.get("weight")
    if weight is not None and (isinstance(weight, bool) or weight not in (0, 1)):
        return FieldProblem(f"{at}.weight", "must be 0 (not trained on) or 1")
    return _string_or_absent(message, "name", at) or _string_or_absent(message, "tool_call_id", at)


def call_arguments(text: str) -> dict[str, Any] | None:
    """A tool call's ``arguments`` (OpenAI gives them as JSON text) as the object they hold,
    or None when the text is not a JSON object."""
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError:
        return None
    return arguments if isinstance(arguments, dict) else None


def _tool_calls_problem(tool_calls: Any, at: str) -> FieldProblem | None:
    if not isinstance(tool_calls, list) or not tool_calls:
        return FieldProblem(at, 'must be a non-empty list of {"id", "type": "function", "function"} objects')
    for i, call in enumerate(tool_calls):
        here = f"{at}[{i}]"
        if not isinstance(call, dict):
            return FieldProblem(here, 'must be an object like {"id", "type": "function", "function"}')
        if call.get("type", "function") != "function":
            return FieldProblem(f"{here}.type", 'must be "function"')
        if (problem := _string_or_absent(call, "id", here)) is not None:
            return problem
        function = call.get("function")
        if not isinstance(function, dict):
            return FieldProblem(f"{here}.function", 'must be an object like {"name", "arguments"}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            return FieldProblem(f"{here}.function.name", "must be a non-empty string")
        arguments = function.get("arguments")
        # Chat templates render the arguments as an object, so they must hold one.
        if not isinstance(arguments, str) or call_arguments(arguments) is None:
            return FieldProblem(
                f"{here}.function.arguments", 'must be a string holding a JSON object, like "{\\"city\\": \\"Oslo\\"}"'
            )
    return None


def tools_problem(tools: Any, at: str) -> FieldProblem | None:
    """A record's ``tools`` (found at ``at``), when it has any: the functions its assistant may call."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        return FieldProblem(at, 'must be a list of {"type": "function", "function": {...}} objects')
    for i, tool in enumerate(tools):
        here = f"{at}[{i}]"
        if not isinstance(tool, dict):
            return FieldProblem(here, 'must be an object like {"type": "function", "function": {...}}')
        if tool.get("type") != "function":
            return FieldProblem(f"{here}.type", 'must be "function"')
        function = tool.get("function")
        if not isinstance(function, dict):
            return FieldProblem(f"{here}.function", 'must be an object like {"name", "description", "parameters"}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            return FieldProblem(f"{here}.function.name", "must be a non-empty string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            return FieldProblem(f"{here}.function.parameters", "must be a JSON Schema object")
    return None


def openai_chat_problem(record: Any) -> FieldProblem | None:
    """What is wrong with one chat record (OpenAI's chat fine-tuning format, which is also the
    native ``messages`` format), or None."""
    if not isinstance(record, dict):
        return FieldProblem(None, 'must be a JSON object like {"messages": [...]}')
    return _chat_problem(record)


def record_problem(record: Any, dataset_format: SftFormat) -> str | None:
    """What is wrong with one record for the given format, or None."""
    if not isinstance(record, dict):
        return f"must be a JSON object like {EXAMPLES[dataset_format]}"
    if dataset_format == "text":
        problem = string_field_problem(record, "text")
    elif dataset_format == "prompt_completion":
        problem = string_field_problem(record, "prompt", may_be_empty=True) or string_field_problem(
            record, "completion"
        )
    else:
        problem = _chat_problem(record)
    return None if problem is None else problem.native_text()


def first_known_record(
    path: Path, *, max_line_bytes: int, kind: str | None = None
) -> tuple[str, dict[str, Any], DatasetFormat] | None:
    """The file's first record with a known format's fields: where it is, the record and its
    format; None when no record has any."""
    for where, item in iter_records(path, max_line_bytes=max_line_bytes, kind=kind):
        if not isinstance(item, FieldProblem) and (found := detect_format(item)) is not None:
            return where, item, found
    return None


def detect_sft_format(path: Path, *, max_line_bytes: int) -> SftFormat:
    """The SFT format of a dataset file, from its first record with known fields. Raises
    DatasetError: naming the method for a file of preference records, else what is wrong."""
    first = first_known_record(path, max_line_bytes=max_line_bytes)
    if first is None:
        # Raises the DatasetError that says what is wrong.
        return read_records(path, max_line_bytes=max_line_bytes).format
    where, record, found = first
    if found == "preference":
        raise DatasetError(preference_refusal(path.name, f"{where} has {answer_fields(record)}"))
    return found


def answer_fields(record: dict[str, Any]) -> str:
    """The preference answer fields a record has, as a message names them: ``"chosen" and "rejected"``."""
    return " and ".join(f'"{name}"' for name in PREFERENCE_ANSWER_FIELDS if name in record)


def preference_refusal(holder: str, evidence: str) -> str:
    """Why a supervised fine-tuning job refuses a file of preference records, whole: ``holder``
    names the file, ``evidence`` says how its records show it (``line 1 has "chosen" and ...``)."""
    return (
        f"{holder} holds preference records ({evidence}), for preference tuning (DPO), which a supervised "
        "fine-tuning (SFT) job cannot train on: an SFT job trains on text, prompt_completion or messages "
        "records, like " + ", or ".join(EXAMPLES.values())
    )


def read_records(path: Path, *, dataset_format: SftFormat | None = None, max_line_bytes: int) -> Records:
    """Every record of a dataset file in one SFT format, or a DatasetError naming the bad ones.

    Without ``dataset_format`` the format is the first record's (by its fields); every
    other record must then have the same fields, and a file of preference records is refused
    whole (``preference_refusal``). ``max_line_bytes``: the longest line of a JSON Lines file
    (``TUNEQ_MAX_LINE_BYTES``).
    """
    records: Records | None = None
    problems: list[RecordProblem] = []
    for where, item in iter_records(path, max_line_bytes=max_line_bytes):
        if isinstance(item, FieldProblem):
            problems.append(RecordProblem(where, item.native_text()))
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
            if chosen == "preference":
                raise DatasetError(preference_refusal(path.name, f"{where} has {answer_fields(item)}"))
            records = Records(format=chosen)
        problem = record_problem(item, records.format)
        if problem is not None:
            problems.append(RecordProblem(where, problem))
        elif not problems:  # once a record is bad, keep reading only to report problems
            records.rows.append(item)
            records.where.append(where)
    if problems:
        raise DatasetError(f"{path.name}: {summary([f'{p.where} {p.message}' for p in problems])}", problems)
    if records is None or not records.rows:
        raise DatasetError(f"{path.name} has no records: add records like {EXAMPLES['text']}")
    return records


def summary(sentences: list[str]) -> str:
    """The first ``MAX_REPORTED_PROBLEMS`` bad records' sentences, and how many more there are."""
    more = len(sentences) - MAX_REPORTED_PROBLEMS
    return "; ".join(sentences[:MAX_REPORTED_PROBLEMS]) + (f"; and {more} more bad records" if more > 0 else "")


# The fields of a message in OpenAI's chat fine-tuning format. An upload (POST /v1/files) is held
# to them, as OpenAI's is; a native dataset may carry more (they are ignored).
OPENAI_MESSAGE_FIELDS = ("role", "content", "name", "weight", "tool_calls", "tool_call_id", "function_call")


def unknown_message_field(messages: Any, at: str) -> FieldProblem | None:
    """The first field of a message in ``messages`` (found at ``at``) that OpenAI's format does
    not have, or None."""
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict) and (unknown := [k for k in message if k not in OPENAI_MESSAGE_FIELDS]):
            fields = ", ".join(OPENAI_MESSAGE_FIELDS)
            return FieldProblem(f"{at}[{i}].{unknown[0]}", f"is not a field of OpenAI's chat format ({fields})")
    return None


def openai_upload_chat_problem(record: Any) -> FieldProblem | None:
    """One record of an upload in OpenAI's chat format: ``openai_chat_problem``, and no message
    field OpenAI does not take."""
    return openai_chat_problem(record) or unknown_message_field(record.get("messages"), "messages")


def check_openai_chat_file(path: Path, *, max_line_bytes: int) -> int:
    """Check an upload against OpenAI's chat fine-tuning format, every line of it, as OpenAI
    does (``openai_upload_chat_problem``): the number of records, or a DatasetError whose
    message names the first bad ones (``line 7: messages[1].role must be one of ...``). Read a
    line at a time, each line at most ``max_line_bytes`` (``TUNEQ_MAX_LINE_BYTES``)."""
    return check_json_lines(
        path, openai_upload_chat_problem, example='{"messages": [...]}', max_line_bytes=max_line_bytes
    )


def check_json_lines(
    path: Path, problem_of: Callable[[Any], FieldProblem | None], *, example: str, max_line_bytes: int
) -> int:
    """Check every line of a JSON Lines file with ``problem_of``, phrasing problems as the
    OpenAI-compatible API does: the number of records, or a DatasetError naming the first bad
    ones. ``example``: a record like the ones the file should hold, for an empty file."""
    problems: list[RecordProblem] = []
    sentences: list[str] = []
    count = 0
    for where, item in iter_records(path, max_line_bytes=max_line_bytes, kind=JSON_LINES):
        found = item if isinstance(item, FieldProblem) else problem_of(item)
        if found is None:
            count += 1
            continue
        problems.append(RecordProblem(where, found.native_text()))
        sentences.append(found.sentence(where))
    if problems:
        raise DatasetError(summary(sentences), problems)
    if count == 0:
        raise DatasetError(f"the file has no records: add one JSON object per line, like {example}")
    return count
