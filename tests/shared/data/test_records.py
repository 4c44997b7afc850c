from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.samples import WEATHER_TOOL
from shared.data.records import DatasetError, FieldProblem, check_openai_chat_file, read_records
from shared.settings import DEFAULT_MAX_LINE_BYTES
from tests.shared.data.chat_records import OPENAI_CHAT, TOOL_CALL

LINE_BYTES = DEFAULT_MAX_LINE_BYTES


def read_text_records(path: Path) -> list[str]:
    records = read_records(path, dataset_format="text", max_line_bytes=LINE_BYTES)
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
    records = read_records(write_jsonl(tmp_path / "d.jsonl", [record, record]), max_line_bytes=LINE_BYTES)
    assert records.format == expected and len(records) == 2
    assert records.where == ["line 1", "line 2"]


def test_unknown_fields_name_the_formats(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as e:
        read_records(write_jsonl(tmp_path / "d.jsonl", [{"question": "q"}]), max_line_bytes=LINE_BYTES)
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
        read_records(path, max_line_bytes=LINE_BYTES)
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
        read_records(path, max_line_bytes=LINE_BYTES)
    assert f"line 2 {expected}" in str(e.value)


def test_forced_format_checks_every_record_against_it(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(DatasetError, match='line 1 has no "prompt" field'):
        read_records(path, dataset_format="prompt_completion", max_line_bytes=LINE_BYTES)


def test_csv_rows_are_read_with_datasets_and_named_by_row(tmp_path: Path) -> None:
    path = write(tmp_path / "d.csv", 'prompt,completion\nhi,"there, you"\nq,\n')
    with pytest.raises(DatasetError) as e:
        read_records(path, max_line_bytes=LINE_BYTES)
    assert 'row 2 has no "completion" field' in str(e.value)
    write(path, 'prompt,completion\nhi,"there, you"\n')
    records = read_records(path, max_line_bytes=LINE_BYTES)
    assert records.format == "prompt_completion" and records.rows[0]["completion"] == "there, you"


def test_csv_messages_and_tools_columns_hold_json(tmp_path: Path) -> None:
    def cell(value: object) -> str:
        return '"' + json.dumps(value).replace('"', '""') + '"'

    rows = f"{cell(CONVERSATION)},\n{cell(OPENAI_CHAT['messages'])},{cell(OPENAI_CHAT['tools'])}\n"
    records = read_records(write(tmp_path / "d.csv", "messages,tools\n" + rows), max_line_bytes=LINE_BYTES)
    assert records.format == "messages" and records.rows[0] == {"messages": CONVERSATION}
    assert records.rows[1] == {"messages": OPENAI_CHAT["messages"], "tools": OPENAI_CHAT["tools"]}


def test_json_array_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = read_records(
        write(tmp_path / "d.json", json.dumps([{"text": "a"}, {"text": "b"}])), max_line_bytes=LINE_BYTES
    )
    assert [r["text"] for r in records.rows] == ["a", "b"] and records.where == ["record 1", "record 2"]
    pq.write_table(pa.table({"messages": [CONVERSATION, CONVERSATION]}), tmp_path / "d.parquet")
    records = read_records(tmp_path / "d.parquet", max_line_bytes=LINE_BYTES)
    assert records.format == "messages" and records.rows[1]["messages"] == CONVERSATION


def test_a_table_of_chat_records_with_and_without_tools(tmp_path: Path) -> None:
    """Arrow gives every message every field some message has, as nulls: read as absent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([OPENAI_CHAT, {"messages": CONVERSATION}]), tmp_path / "d.parquet")
    records = read_records(tmp_path / "d.parquet", max_line_bytes=LINE_BYTES)
    assert records.format == "messages" and records.rows[1] == {"messages": CONVERSATION}
    tool_calling = {k: v for k, v in OPENAI_CHAT["messages"][4].items() if v is not None}
    assert records.rows[0]["messages"][4] == tool_calling and records.rows[0]["tools"] == [WEATHER_TOOL]
    assert records.rows[0]["messages"][:4] + records.rows[0]["messages"][5:] == (
        OPENAI_CHAT["messages"][:4] + OPENAI_CHAT["messages"][5:]
    )


def test_unreadable_table_says_so(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"d.parquet cannot be read as PARQUET"):
        read_records(write(tmp_path / "d.parquet", "not parquet"), max_line_bytes=LINE_BYTES)


def with_message(index: int, **fields: object) -> dict[str, object]:
    """OPENAI_CHAT with message ``index`` changed (a field set to None is removed)."""
    messages = [dict(m) for m in OPENAI_CHAT["messages"]]
    messages[index].update(fields)
    messages[index] = {k: v for k, v in messages[index].items() if v is not None or k == "content"}
    return {**OPENAI_CHAT, "messages": messages}


def test_openai_chat_records_with_tools_and_weights_are_accepted(tmp_path: Path) -> None:
    assert (
        check_openai_chat_file(
            write_jsonl(tmp_path / "d.jsonl", [OPENAI_CHAT, {"messages": CONVERSATION}]), max_line_bytes=LINE_BYTES
        )
        == 2
    )


def test_the_native_messages_format_is_openais_chat_format(tmp_path: Path) -> None:
    """POST /jobs reads what POST /v1/files accepts: developer, tool calls, weights, tools."""
    records = read_records(
        write_jsonl(tmp_path / "d.jsonl", [OPENAI_CHAT, {"messages": CONVERSATION}]), max_line_bytes=LINE_BYTES
    )
    assert records.format == "messages" and records.rows == [OPENAI_CHAT, {"messages": CONVERSATION}]


def test_null_optional_fields_count_as_absent(tmp_path: Path) -> None:
    """As transformers treats them, and as a table gives the fields a record lacks."""
    record = with_message(2, tool_calls=None, weight=None, name=None)
    record["messages"][2].update(tool_calls=None, weight=None, name=None)
    record["messages"][3]["tool_call_id"] = None
    assert (
        check_openai_chat_file(
            write_jsonl(tmp_path / "d.jsonl", [{**record, "tools": None}]), max_line_bytes=LINE_BYTES
        )
        == 1
    )


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
        check_openai_chat_file(path, max_line_bytes=LINE_BYTES)
    assert str(e.value).startswith(f"line 7: {expected}"), str(e.value)
    assert [p.line for p in e.value.problems] == [7]
    # The native format refuses the same record by the same rule, as it phrases problems.
    with pytest.raises(DatasetError) as native:
        read_records(path, dataset_format="messages", max_line_bytes=LINE_BYTES)
    assert [p.line for p in native.value.problems] == [7]
    field, _, rest = expected.partition(" ")
    if field != "the":  # the record as a whole: phrased as each format's example
        assert f"line 7 {FieldProblem(field, rest).native_text()}" in str(native.value), str(native.value)


def test_an_upload_is_held_to_openais_message_fields_and_a_native_dataset_is_not(tmp_path: Path) -> None:
    """OpenAI refuses a message field its format does not have; so does POST /v1/files. A native
    dataset may carry more (ignored), as the HF Trainer's data often does."""
    record = with_message(3, mood="cheerful")
    path = write_jsonl(tmp_path / "d.jsonl", [OPENAI_CHAT] * 6 + [record])
    with pytest.raises(DatasetError) as e:
        check_openai_chat_file(path, max_line_bytes=LINE_BYTES)
    assert str(e.value).startswith("line 7: messages[3].mood is not a field of OpenAI's chat format (role, content"), e
    assert read_records(path, dataset_format="messages", max_line_bytes=LINE_BYTES).rows[6] == record


def test_openai_chat_file_problems_are_summarised_and_json_errors_named(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", json.dumps(OPENAI_CHAT) + "\n\n{oops\n" + '{"text": "x"}\n' * 6)
    with pytest.raises(DatasetError) as e:
        check_openai_chat_file(path, max_line_bytes=LINE_BYTES)
    message = str(e.value)
    assert message.startswith("line 3: the record is not valid JSON (")  # the blank line 2 still counts
    assert "; line 4: messages must be a non-empty list" in message
    assert "line 7: messages" in message and "line 8" not in message and message.endswith("; and 2 more bad records")
    assert len(e.value.problems) == 7


def test_an_openai_chat_file_without_records_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="the file has no records"):
        check_openai_chat_file(write(tmp_path / "d.jsonl", "\n \n"), max_line_bytes=LINE_BYTES)


# Every record of every file type gets a request body's limits (shared.json_values): what a
# tokenizer cannot encode (a lone surrogate, written as the JSON escape) or Postgres cannot store
# (NUL), anywhere in the record, and nesting no parser should recurse through.
SURROGATE, NUL = "h\ud800i", "a\x00b"
CHAT_WITH_TOOL_CALL = OPENAI_CHAT["messages"][4]
HOSTILE_RECORDS = [
    ({"text": f"hello {SURROGATE} there"}, 'field "text" contains a lone UTF-16 surrogate'),
    ({"prompt": NUL, "completion": "x"}, 'field "prompt" contains a NUL character'),
    ({"prompt": "q", "completion": "x", "source": SURROGATE}, 'field "source" contains a lone UTF-16 surrogate'),
    (with_message(2, content=SURROGATE), "field messages[2].content contains a lone UTF-16 surrogate"),
    (
        with_message(
            4, tool_calls=[{**TOOL_CALL, "function": {"name": "get_weather", "arguments": f'{{"c": "{NUL}"}}'}}]
        ),
        "field messages[4].tool_calls[0].function.arguments contains a NUL character",
    ),
    (with_message(4, tool_calls=[{**TOOL_CALL, "id": NUL}]), "field messages[4].tool_calls[0].id contains a NUL"),
    (
        {**OPENAI_CHAT, "tools": [{**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "description": NUL}}]},
        "field tools[0].function.description contains a NUL character",
    ),
    (
        {**OPENAI_CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {SURROGATE: {}}}}]},
        "field tools[0].function.parameters has a key that contains a lone UTF-16 surrogate",
    ),
    ({"text": "x", SURROGATE: 1}, "has a key that contains a lone UTF-16 surrogate"),
]


@pytest.mark.parametrize(("record", "expected"), HOSTILE_RECORDS)
def test_a_string_no_tokenizer_or_database_takes_is_refused_naming_line_and_field(
    tmp_path: Path, record: dict[str, object], expected: str
) -> None:
    good = (
        OPENAI_CHAT
        if "messages" in record
        else {"text": "ok"}
        if "text" in record
        else {"prompt": "q", "completion": "a"}
    )
    path = write_jsonl(tmp_path / "d.jsonl", [good, record, good])
    assert "\\u" in path.read_text().splitlines()[1]  # written as JSON escapes, as a file holds them
    with pytest.raises(DatasetError) as e:
        read_records(path, max_line_bytes=LINE_BYTES)
    assert f"d.jsonl: line 2 {expected}" in str(e.value), str(e.value)
    assert [p.line for p in e.value.problems] == [2]
    if "messages" in record:  # an upload's check, in its own phrasing: "line 2: messages[2].content ..."
        with pytest.raises(DatasetError) as upload:
            check_openai_chat_file(path, max_line_bytes=LINE_BYTES)
        assert str(upload.value).startswith(f"line 2: {expected.removeprefix('field ')}"), str(upload.value)


def test_every_file_type_refuses_them_by_record_and_row(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    as_json = write(tmp_path / "d.json", json.dumps([{"text": "a"}, {"text": NUL}]))
    conversation = [{"role": "user", "content": SURROGATE}, {"role": "assistant", "content": "x"}]
    cell = '"' + json.dumps(conversation).replace('"', '""') + '"'  # CSV: the cell holds JSON text
    as_csv = write(tmp_path / "d.csv", f"messages\n{cell}\n")
    as_csv_with_nul = tmp_path / "n.csv"
    as_csv_with_nul.write_bytes(b'prompt,completion\nq,"a\x00b"\n')
    pq.write_table(pa.table({"prompt": ["q", "q"], "completion": ["a", NUL]}), tmp_path / "d.parquet")
    for path, expected in [
        (as_json, 'd.json: record 2 field "text" contains a NUL character'),
        (as_csv, "d.csv: row 1 field messages[0].content contains a lone UTF-16 surrogate"),
        (as_csv_with_nul, 'n.csv: row 1 field "completion" contains a NUL character'),
        (tmp_path / "d.parquet", 'd.parquet: row 2 field "completion" contains a NUL character'),
    ]:
        with pytest.raises(DatasetError) as e:
            read_records(path, max_line_bytes=LINE_BYTES)
        assert str(e.value).startswith(expected), str(e.value)


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_a_record_nested_past_a_request_body_s_depth_is_refused_by_line_never_by_recursion(tmp_path: Path) -> None:
    from shared.json_values import MAX_DEPTH

    # {"text", "meta": [[...]]}: "meta" is one level, so its lists may nest MAX_DEPTH - 1 deep.
    at_the_limit = f'{{"text": "x", "meta": {nested(MAX_DEPTH)}}}'
    assert len(read_records(write(tmp_path / "ok.jsonl", at_the_limit + "\n"), max_line_bytes=LINE_BYTES)) == 1
    lines = [
        '{"text": "ok"}',
        f'{{"text": "x", "meta": {nested(MAX_DEPTH + 1)}}}',
        f'{{"text": "x", "meta": {nested(5000)}}}',  # past Python's recursion limit: json.loads gives up
    ]
    path = write(tmp_path / "d.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as e:
        read_records(path, max_line_bytes=LINE_BYTES)
    assert str(e.value) == (
        f'd.jsonl: line 2 field "meta" is nested deeper than {MAX_DEPTH} levels, which no record needs: '
        f"flatten it; line 3 is nested deeper than {MAX_DEPTH} levels, which no record needs: flatten it"
    )
    chat = json.dumps({**OPENAI_CHAT, "tools": "TOOLS"}).replace('"TOOLS"', nested(5000))
    with pytest.raises(DatasetError, match=r"^line 1: the record is nested deeper than 32 levels"):
        check_openai_chat_file(write(tmp_path / "c.jsonl", chat + "\n"), max_line_bytes=LINE_BYTES)
    cell = nested(5000)
    with pytest.raises(DatasetError, match=r"d.csv: row 1 is nested deeper than 32 levels"):
        read_records(write(tmp_path / "d.csv", f"messages\n{cell}\n"), max_line_bytes=LINE_BYTES)
    as_json = write(tmp_path / "d.json", json.dumps([{"text": "a", "meta": "META"}]).replace('"META"', nested(40)))
    with pytest.raises(DatasetError, match=r'd.json: record 1 field "meta" is nested deeper than 32 levels'):
        read_records(as_json, max_line_bytes=LINE_BYTES)


def test_a_line_past_max_line_bytes_is_refused_by_number_and_the_lines_after_it_still_read(tmp_path: Path) -> None:
    limit = 100
    exactly = '{"text": "' + "a" * (limit - 12) + '"}'
    assert len(exactly) == limit
    longer = '{"text": "' + "a" * (limit - 11) + '"}'
    path = write(tmp_path / "d.jsonl", f"{exactly}\n{longer}\n{exactly}\n{{oops\n{longer}")  # the last without \n
    with pytest.raises(DatasetError) as e:
        read_records(path, max_line_bytes=limit)
    too_long = "is longer than 100 bytes, the most one line may hold (TUNEQ_MAX_LINE_BYTES): shorten the record"
    assert str(e.value).startswith(f"d.jsonl: line 2 {too_long}"), str(e.value)
    assert [p.line for p in e.value.problems] == [2, 4, 5]
    with pytest.raises(DatasetError) as upload:  # not chat records either, but line 2 is named as too long
        check_openai_chat_file(path, max_line_bytes=limit)
    assert f"; line 2: the record {too_long}" in str(upload.value), str(upload.value)
    assert len(read_records(write(tmp_path / "ok.jsonl", f"{exactly}\n{exactly}"), max_line_bytes=limit)) == 2


def test_a_line_far_past_the_bound_is_never_held_whole(tmp_path: Path) -> None:
    """What the probe sent: one valid line of tens of MB, which the reader used to read (and
    parse) whole. Refused having held at most about the bound."""
    import tracemalloc

    limit = 64 * 1024
    path = tmp_path / "d.jsonl"
    with path.open("w", encoding="utf-8") as f:
        f.write('{"text": "')
        for _ in range(32):
            f.write("a" * 1024**2)
        f.write('"}\n{"text": "fine"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError, match=r"^d.jsonl: line 1 is longer than 65536 bytes") as e:
            read_records(path, max_line_bytes=limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [p.line for p in e.value.problems] == [1]
    assert peak < 8 * limit, f"held {peak} bytes reading a {path.stat().st_size}-byte line with a {limit}-byte bound"


def test_lines_after_one_that_is_not_utf8_are_still_read_and_numbered(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n\xff\xfe\n{"text": 3}\n')
    with pytest.raises(DatasetError) as e:
        read_text_records(path)
    assert [p.line for p in e.value.problems] == [2, 3]
