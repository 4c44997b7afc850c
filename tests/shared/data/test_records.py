from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.samples import WEATHER_TOOL
from shared.data.records import DatasetError, FieldProblem, check_openai_chat_file, read_records
from tests.shared.data.chat_records import OPENAI_CHAT, TOOL_CALL


def read_text_records(path: Path) -> list[str]:
    records = read_records(path, dataset_format="text")
    return [r["text"] for r in records.rows]


def write(path: Path, content: str) -> Path:
    path.write_text(content, encoding="utf-8")
    return path


def test_reads_texts_and_skips_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", '{"text": "a b"}\n\n{"text": "c", "extra": 1}\n')
    assert read_text_records(path) == ["a b", "c"]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "line 2 is not valid JSON"),
        ('["text"]', "line 2 must be a JSON object like"),
        ('{"txt": "x"}', 'line 2 has no "text" field'),
        ('{"text": 3}', 'line 2 field "text" must be a string'),
        ('{"text": "  "}', 'line 2 field "text" is empty'),
    ],
)
def test_bad_line_is_named_by_number(tmp_path: Path, line: str, expected: str) -> None:
    path = write(tmp_path / "d.jsonl", '{"text": "ok"}\n' + line + "\n")
    with pytest.raises(DatasetError) as e:
        read_text_records(path)
    assert expected in str(e.value)
    assert e.value.problems[0].line == 2


def test_many_bad_lines_are_summarised(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", "x\n" * 9)
    with pytest.raises(DatasetError) as e:
        read_text_records(path)
    assert "line 5" in str(e.value) and "line 6" not in str(e.value)
    assert "and 4 more bad records" in str(e.value)


def test_empty_dataset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="has no records"):
        read_text_records(write(tmp_path / "d.jsonl", "\n\n"))


def test_invalid_utf8_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n\xff\xfe\n')
    with pytest.raises(DatasetError, match="not valid UTF-8"):
        read_text_records(path)


def write_jsonl(path: Path, records: list[object]) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in records))


CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"text": "a"}, "text"),
        ({"prompt": "q", "completion": "a"}, "prompt_completion"),
        ({"messages": CONVERSATION}, "messages"),
        ({"prompt": "q", "completion": "a", "text": "t"}, "prompt_completion"),
    ],
)
def test_format_is_detected_from_the_fields(tmp_path: Path, record: dict[str, object], expected: str) -> None:
    records = read_records(write_jsonl(tmp_path / "d.jsonl", [record, record]))
    assert records.format == expected and len(records) == 2
    assert records.where == ["line 1", "line 2"]


def test_unknown_fields_name_the_formats(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as e:
        read_records(write_jsonl(tmp_path / "d.jsonl", [{"question": "q"}]))
    assert "line 1 has none of the fields of a known format" in str(e.value)
    assert '{"prompt": "...", "completion": "..."}' in str(e.value) and "training.dataset_format" in str(e.value)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"prompt": "q"}, 'line 2 has no "completion" field'),
        ({"prompt": 1, "completion": "a"}, 'line 2 field "prompt" must be a string'),
        ({"prompt": "q", "completion": " "}, 'line 2 field "completion" is empty'),
    ],
)
def test_prompt_completion_problems(tmp_path: Path, record: dict[str, object], expected: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "", "completion": "a"}, record])
    with pytest.raises(DatasetError) as e:
        read_records(path)
    assert expected in str(e.value)


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([], 'field "messages" must be a non-empty list'),
        ("hello", 'field "messages" must be a non-empty list'),  # JSON text is read as JSON in CSV cells only
        (
            [{"role": "robot", "content": "x"}],
            "field messages[0].role must be one of system, developer, user, assistant",
        ),
        ([{"role": "user", "content": 3}], "field messages[0].content must be a string"),
        ([{"role": "user", "content": "hi"}], 'field "messages" has no assistant message to train on'),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
            'field "messages" has no assistant',
        ),
        (["hi"], "field messages[0] must be an object"),
    ],
)
def test_messages_problems(tmp_path: Path, messages: object, expected: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}, {"messages": messages}])
    with pytest.raises(DatasetError) as e:
        read_records(path)
    assert f"line 2 {expected}" in str(e.value)


def test_forced_format_checks_every_record_against_it(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(DatasetError, match='line 1 has no "prompt" field'):
        read_records(path, dataset_format="prompt_completion")


def test_csv_rows_are_read_with_datasets_and_named_by_row(tmp_path: Path) -> None:
    path = write(tmp_path / "d.csv", 'prompt,completion\nhi,"there, you"\nq,\n')
    with pytest.raises(DatasetError) as e:
        read_records(path)
    assert 'row 2 has no "completion" field' in str(e.value)
    write(path, 'prompt,completion\nhi,"there, you"\n')
    records = read_records(path)
    assert records.format == "prompt_completion" and records.rows[0]["completion"] == "there, you"


def test_csv_messages_and_tools_columns_hold_json(tmp_path: Path) -> None:
    def cell(value: object) -> str:
        return '"' + json.dumps(value).replace('"', '""') + '"'

    rows = f"{cell(CONVERSATION)},\n{cell(OPENAI_CHAT['messages'])},{cell(OPENAI_CHAT['tools'])}\n"
    records = read_records(write(tmp_path / "d.csv", "messages,tools\n" + rows))
    assert records.format == "messages" and records.rows[0] == {"messages": CONVERSATION}
    assert records.rows[1] == {"messages": OPENAI_CHAT["messages"], "tools": OPENAI_CHAT["tools"]}


def test_json_array_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = read_records(write(tmp_path / "d.json", json.dumps([{"text": "a"}, {"text": "b"}])))
    assert [r["text"] for r in records.rows] == ["a", "b"] and records.where == ["record 1", "record 2"]
    pq.write_table(pa.table({"messages": [CONVERSATION, CONVERSATION]}), tmp_path / "d.parquet")
    records = read_records(tmp_path / "d.parquet")
    assert records.format == "messages" and records.rows[1]["messages"] == CONVERSATION


def test_a_table_of_chat_records_with_and_without_tools(tmp_path: Path) -> None:
    """Arrow gives every message every field some message has, as nulls: read as absent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([OPENAI_CHAT, {"messages": CONVERSATION}]), tmp_path / "d.parquet")
    records = read_records(tmp_path / "d.parquet")
    assert records.format == "messages" and records.rows[1] == {"messages": CONVERSATION}
    tool_calling = {k: v for k, v in OPENAI_CHAT["messages"][4].items() if v is not None}
    assert records.rows[0]["messages"][4] == tool_calling and records.rows[0]["tools"] == [WEATHER_TOOL]
    assert records.rows[0]["messages"][:4] + records.rows[0]["messages"][5:] == (
        OPENAI_CHAT["messages"][:4] + OPENAI_CHAT["messages"][5:]
    )


def test_unreadable_table_says_so(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"d.parquet cannot be read as PARQUET"):
        read_records(write(tmp_path / "d.parquet", "not parquet"))


def with_message(index: int, **fields: object) -> dict[str, object]:
    """OPENAI_CHAT with message ``index`` changed (a field set to None is removed)."""
    messages = [dict(m) for m in OPENAI_CHAT["messages"]]
    messages[index].update(fields)
    messages[index] = {k: v for k, v in messages[index].items() if v is not None or k == "content"}
    return {**OPENAI_CHAT, "messages": messages}


def test_openai_chat_records_with_tools_and_weights_are_accepted(tmp_path: Path) -> None:
    assert check_openai_chat_file(write_jsonl(tmp_path / "d.jsonl", [OPENAI_CHAT, {"messages": CONVERSATION}])) == 2


def test_the_native_messages_format_is_openais_chat_format(tmp_path: Path) -> None:
    """POST /jobs reads what POST /v1/files accepts: developer, tool calls, weights, tools."""
    records = read_records(write_jsonl(tmp_path / "d.jsonl", [OPENAI_CHAT, {"messages": CONVERSATION}]))
    assert records.format == "messages" and records.rows == [OPENAI_CHAT, {"messages": CONVERSATION}]


def test_null_optional_fields_count_as_absent(tmp_path: Path) -> None:
    """As transformers treats them, and as a table gives the fields a record lacks."""
    record = with_message(2, tool_calls=None, weight=None, name=None)
    record["messages"][2].update(tool_calls=None, weight=None, name=None)
    record["messages"][3]["tool_call_id"] = None
    assert check_openai_chat_file(write_jsonl(tmp_path / "d.jsonl", [{**record, "tools": None}])) == 1


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (with_message(1, role="robot"), "messages[1].role must be one of system, developer, user, assistant, tool"),
        ({"messages": []}, 'messages must be a non-empty list of {"role", "content"} objects'),
        ({"messages": json.dumps(CONVERSATION)}, "messages must be a non-empty list"),  # a string: CSV only
        (["hi"], 'the record must be a JSON object like {"messages": [...]}'),
        (with_message(2, content=None), "messages[2].content must be a string"),
        (with_message(2, content=[{"type": "text", "text": "hi"}]), "messages[2].content must be a string"),
        (with_message(4, tool_calls=None), "messages[4].content must be a string, or null on an assistant message"),
        (with_message(4, tool_calls=[]), "messages[4].tool_calls must be a non-empty list"),
        (
            with_message(4, tool_calls=[{**TOOL_CALL, "type": "code"}]),
            'messages[4].tool_calls[0].type must be "function"',
        ),
        (
            with_message(4, tool_calls=[{**TOOL_CALL, "function": {"name": "f", "arguments": {"city": "Oslo"}}}]),
            "messages[4].tool_calls[0].function.arguments must be a string",
        ),
        (
            with_message(4, tool_calls=[{**TOOL_CALL, "function": {"name": "f", "arguments": '"Oslo"'}}]),
            'messages[4].tool_calls[0].function.arguments must be a string holding a JSON object, like "{\\"city',
        ),
        (
            with_message(4, tool_calls=[{**TOOL_CALL, "function": {"name": "", "arguments": "{}"}}]),
            "messages[4].tool_calls[0].function.name must be a non-empty string",
        ),
        (with_message(2, tool_calls=[TOOL_CALL]), "messages[2].tool_calls is only allowed on assistant messages"),
        (with_message(2, weight=0), "messages[2].weight is only allowed on assistant messages"),
        (with_message(3, weight=2), "messages[3].weight must be 0 (not trained on) or 1"),
        (with_message(3, weight=True), "messages[3].weight must be 0 (not trained on) or 1"),
        (with_message(5, tool_call_id=5), "messages[5].tool_call_id must be a string"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": 0}]},
            "messages has no assistant message to train on",
        ),
        ({**OPENAI_CHAT, "tools": {"get_weather": {}}}, "tools must be a list"),
        ({**OPENAI_CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name must be"),
    ],
)
def test_a_bad_chat_record_is_named_by_line_and_field(tmp_path: Path, record: object, expected: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [OPENAI_CHAT] * 6 + [record] + [OPENAI_CHAT])
    with pytest.raises(DatasetError) as e:
        check_openai_chat_file(path)
    assert str(e.value).startswith(f"line 7: {expected}"), str(e.value)
    assert [p.line for p in e.value.problems] == [7]
    # The native format refuses the same record by the same rule, as it phrases problems.
    with pytest.raises(DatasetError) as native:
        read_records(path, dataset_format="messages")
    assert [p.line for p in native.value.problems] == [7]
    field, _, rest = expected.partition(" ")
    if field != "the":  # the record as a whole: phrased as each format's example
        assert f"line 7 {FieldProblem(field, rest).native_text()}" in str(native.value), str(native.value)


def test_openai_chat_file_problems_are_summarised_and_json_errors_named(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", json.dumps(OPENAI_CHAT) + "\n\n{oops\n" + '{"text": "x"}\n' * 6)
    with pytest.raises(DatasetError) as e:
        check_openai_chat_file(path)
    message = str(e.value)
    assert message.startswith("line 3: the record is not valid JSON (")  # the blank line 2 still counts
    assert "; line 4: messages must be a non-empty list" in message
    assert "line 7: messages" in message and "line 8" not in message and message.endswith("; and 2 more bad records")
    assert len(e.value.problems) == 7


def test_an_openai_chat_file_without_records_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="the file has no records"):
        check_openai_chat_file(write(tmp_path / "d.jsonl", "\n \n"))
