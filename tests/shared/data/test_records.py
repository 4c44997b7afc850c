from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.data.records import DatasetError, read_records


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
        ("hello", 'field "messages" must be a list'),
        ([{"role": "robot", "content": "x"}], "field messages[0].role must be one of system, user, assistant"),
        ([{"role": "user", "content": 3}], "field messages[0].content must be a string"),
        ([{"role": "user", "content": "hi"}], 'has no non-empty "assistant" message'),
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


def test_csv_messages_column_holds_json(tmp_path: Path) -> None:
    cell = json.dumps(CONVERSATION).replace('"', '""')
    records = read_records(write(tmp_path / "d.csv", f'messages\n"{cell}"\n'))
    assert records.format == "messages" and records.rows[0]["messages"] == CONVERSATION


def test_json_array_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = read_records(write(tmp_path / "d.json", json.dumps([{"text": "a"}, {"text": "b"}])))
    assert [r["text"] for r in records.rows] == ["a", "b"] and records.where == ["record 1", "record 2"]
    pq.write_table(pa.table({"messages": [CONVERSATION, CONVERSATION]}), tmp_path / "d.parquet")
    records = read_records(tmp_path / "d.parquet")
    assert records.format == "messages" and records.rows[1]["messages"] == CONVERSATION


def test_unreadable_table_says_so(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"d.parquet cannot be read as PARQUET"):
        read_records(write(tmp_path / "d.parquet", "not parquet"))
