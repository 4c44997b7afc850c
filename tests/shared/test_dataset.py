from __future__ import annotations

from pathlib import Path

import pytest

from shared.dataset import DatasetError, read_text_records


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
        ('["text"]', "line 2 must be a JSON object"),
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
    assert "and 4 more bad lines" in str(e.value)


def test_empty_dataset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="has no records"):
        read_text_records(write(tmp_path / "d.jsonl", "\n\n"))


def test_invalid_utf8_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n\xff\xfe\n')
    with pytest.raises(DatasetError, match="not valid UTF-8"):
        read_text_records(path)
