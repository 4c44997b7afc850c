"""Preference records: both shapes read into one pair, their checks, and an SFT job's refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli.samples import WEATHER_TOOL
from shared.data.preference import PreferencePair, read_preference_records
from shared.data.records import DatasetError, detect_sft_format, read_records
from shared.data.uploaded_files import check_uploaded_file
from shared.settings import DEFAULT_MAX_LINE_BYTES
from tests.shared.data.preference_records import OPENAI_DPO, OTHER, PREFERRED, PROMPT, SHAPES, TRL_EXPLICIT

LINE_BYTES = DEFAULT_MAX_LINE_BYTES
USER = {"role": "user", "content": "Who sees a tree?"}
CAT = {"role": "assistant", "content": "The cat."}
DOG = {"role": "assistant", "content": "A dog."}


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_reads_as_the_same_pair(tmp_path: Path, shape: str) -> None:
    records = read_preference_records(write_jsonl(tmp_path / "p.jsonl", [SHAPES[shape]] * 2), max_line_bytes=LINE_BYTES)
    assert records.shape == shape.removesuffix("-implicit")
    assert records.pairs == [PreferencePair(PROMPT, PREFERRED, OTHER, [WEATHER_TOOL])] * 2
    assert records.where == ["line 1", "line 2"]


@pytest.mark.parametrize(
    ("record", "pair"),
    [
        ({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, ("The sky is", " blue.", " green.")),
        # TRL's implicit prompt, split as trl.extract_prompt splits it: the space goes with the answers.
        ({"chosen": "The sky is blue.", "rejected": "The sky is green."}, ("The sky is", " blue.", " green.")),
        ({"prompt": "", "chosen": "Yes.", "rejected": "No."}, ("", "Yes.", "No.")),
    ],
)
def test_text_pairs_and_the_implicit_prompt(tmp_path: Path, record: dict[str, Any], pair: tuple[str, ...]) -> None:
    records = read_preference_records(write_jsonl(tmp_path / "p.jsonl", [record]), max_line_bytes=LINE_BYTES)
    assert records.pairs == [PreferencePair(*pair)]


def test_an_implicit_prompt_is_the_messages_both_conversations_begin_with(tmp_path: Path) -> None:
    second = {"role": "user", "content": "And a ball?"}
    record = {"chosen": [USER, CAT, second, DOG], "rejected": [USER, CAT, second, CAT]}
    records = read_preference_records(write_jsonl(tmp_path / "p.jsonl", [record]), max_line_bytes=LINE_BYTES)
    assert records.pairs == [PreferencePair([USER, CAT, second], [DOG], [CAT])]


def bad(record: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``record`` with fields replaced (or, given None, removed)."""
    changed = {**record, **changes}
    return {name: value for name, value in changed.items() if value is not None}


ASSISTANT_ROLE = 'must be "assistant"'
BAD_RECORDS = [
    # A missing answer.
    (bad(TRL_EXPLICIT, rejected=None), 'field "rejected" is missing: a preference record needs two answers'),
    (bad(OPENAI_DPO, non_preferred_output=None), 'field "non_preferred_output" is missing'),
    # An empty preferred output.
    (bad(OPENAI_DPO, preferred_output=[]), 'field "preferred_output" must be a non-empty list of assistant messages'),
    (
        bad(OPENAI_DPO, preferred_output=[{"role": "assistant", "content": " "}]),
        'field "preferred_output" is empty: give the assistant\'s answer',
    ),
    ({"prompt": "Who?", "chosen": "", "rejected": "A dog."}, 'field "chosen" is empty'),
    # Answers that are not assistant messages: no assistant turn in them.
    (bad(TRL_EXPLICIT, chosen=[USER]), f"field chosen[0].role {ASSISTANT_ROLE}"),
    (bad(OPENAI_DPO, non_preferred_output=[CAT, USER]), f"field non_preferred_output[1].role {ASSISTANT_ROLE}"),
    # Identical answers.
    ({"prompt": "Who?", "chosen": "A dog.", "rejected": "A dog."}, 'field "rejected" is identical to chosen'),
    (bad(OPENAI_DPO, non_preferred_output=PREFERRED), 'field "non_preferred_output" is identical to preferred_output'),
    ({"chosen": [USER, CAT], "rejected": [USER, CAT]}, 'field "rejected" is identical to chosen'),
    # Implicit prompts: nothing shared, or no assistant answer after what is shared.
    ({"chosen": "Yes, it is.", "rejected": "No, it is not."}, 'field "chosen" and rejected share no beginning'),
    ({"chosen": [USER, CAT], "rejected": [CAT, DOG]}, 'field "chosen" and rejected share no first message'),
    ({"chosen": [USER], "rejected": [USER, DOG]}, 'field "chosen" has no assistant answer after the message it shares'),
    ({"chosen": [USER, CAT, USER, DOG], "rejected": [USER, DOG]}, f"field chosen[2].role {ASSISTANT_ROLE}"),
    # The rest of the rules of chat records, at their place in the record.
    (bad(TRL_EXPLICIT, prompt="Weather?"), 'field "prompt" must be a list of messages, as chosen is'),
    (
        bad(OPENAI_DPO, input={"messages": [{"role": "robot", "content": "x"}]}),
        "field input.messages[0].role must be one of system, developer, user, assistant, tool",
    ),
    (bad(OPENAI_DPO, input=None), 'field "input" must be an object like {"messages": [...], "tools": [...]}'),
    (
        bad(
            OPENAI_DPO,
            preferred_output=[{**PREFERRED[0], "tool_calls": [{"function": {"name": "f", "arguments": "x"}}]}],
        ),
        "field preferred_output[0].tool_calls[0].function.arguments must be a string holding a JSON object",
    ),
    (bad(OPENAI_DPO, input={"messages": PROMPT, "tools": "all"}), "field input.tools must be a list"),
    (bad(OPENAI_DPO, preferred_output=[{**CAT, "weight": 0}]), "field preferred_output[0].weight is for supervised"),
]


@pytest.mark.parametrize(("record", "said"), BAD_RECORDS)
def test_a_bad_record_is_named_by_its_line_and_field(tmp_path: Path, record: dict[str, Any], said: str) -> None:
    good = OPENAI_DPO if "preferred_output" in record or "non_preferred_output" in record else TRL_EXPLICIT
    path = write_jsonl(tmp_path / "p.jsonl", [good, record, good])
    with pytest.raises(DatasetError) as e:
        read_preference_records(path, max_line_bytes=LINE_BYTES)
    assert str(e.value).startswith(f"p.jsonl: line 2 {said}"), str(e.value)
    assert [p.line for p in e.value.problems] == [2]


@pytest.mark.parametrize(
    ("record", "evidence"),
    [(TRL_EXPLICIT, '"chosen" and "rejected"'), (OPENAI_DPO, '"preferred_output" and "non_preferred_output"')],
)
def test_an_sft_job_refuses_a_preference_file_whole_naming_the_method(
    tmp_path: Path, record: dict[str, Any], evidence: str
) -> None:
    # The second line is no preference record: the file is refused for what it holds, not line by line.
    path = write_jsonl(tmp_path / "p.jsonl", [record, {"text": "x"}])
    said = (
        f"p.jsonl holds preference records (line 1 has {evidence}), for preference tuning (DPO), which a supervised "
        "fine-tuning (SFT) job cannot train on: an SFT job trains on text, prompt_completion or messages records, "
        'like {"text": "..."}'
    )
    for read in (read_records, detect_sft_format):
        with pytest.raises(DatasetError) as e:
            read(path, max_line_bytes=LINE_BYTES)
        assert str(e.value).startswith(said), str(e.value)


@pytest.mark.parametrize(
    ("record", "evidence"),
    [
        ({"messages": [USER, CAT]}, '"messages"'),
        ({"prompt": "Who?", "completion": " A cat."}, '"prompt" and "completion"'),
        ({"text": "A cat sees a tree."}, '"text"'),
    ],
)
def test_a_dpo_job_refuses_a_supervised_file_whole_naming_the_method(
    tmp_path: Path, record: dict[str, Any], evidence: str
) -> None:
    # The second line is a preference record: the file is refused for what its first holds, not line by line.
    path = write_jsonl(tmp_path / "dataset.jsonl", [record, TRL_EXPLICIT])
    with pytest.raises(DatasetError) as e:
        read_preference_records(path, max_line_bytes=LINE_BYTES)
    assert str(e.value) == (
        f"dataset.jsonl holds supervised records (line 1 has {evidence}), for supervised fine-tuning (SFT), which "
        'a DPO job cannot train on: a DPO job trains on preference records, like {"prompt": "...", "chosen": '
        '"...", "rejected": "..."} (TRL\'s preference format), or {"input": {"messages": [{"role": "user", '
        '"content": "..."}]}, "preferred_output": [{"role": "assistant", "content": "..."}], '
        '"non_preferred_output": [{"role": "assistant", "content": "..."}]} (OpenAI\'s DPO format)'
    )
    assert e.value.problems == []
    # A line no format knows before it changes nothing: the first record with a format's fields decides.
    path = write_jsonl(tmp_path / "dataset.jsonl", [{"id": 1}, record])
    with pytest.raises(DatasetError) as e:
        read_preference_records(path, max_line_bytes=LINE_BYTES)
    assert str(e.value).startswith(f"dataset.jsonl holds supervised records (line 2 has {evidence})"), str(e.value)


def test_openai_dpo_records_in_csv_cells_are_read_as_json(tmp_path: Path) -> None:
    cells = [
        json.dumps(OPENAI_DPO[name]).replace('"', '""')
        for name in ("input", "preferred_output", "non_preferred_output")
    ]
    path = tmp_path / "p.csv"
    path.write_text("input,preferred_output,non_preferred_output\n" + ",".join(f'"{c}"' for c in cells) + "\n")
    records = read_preference_records(path, max_line_bytes=LINE_BYTES)
    assert records.pairs == [PreferencePair(PROMPT, PREFERRED, OTHER, [WEATHER_TOOL])]


def test_an_upload_is_chat_or_openai_dpo_records_every_line_checked(tmp_path: Path) -> None:
    checked = check_uploaded_file(write_jsonl(tmp_path / "dpo.jsonl", [OPENAI_DPO] * 3), max_line_bytes=LINE_BYTES)
    assert (checked.dataset_format, checked.records) == ("preference", 3)
    chat = {"messages": [USER, CAT]}
    assert check_uploaded_file(write_jsonl(tmp_path / "c.jsonl", [chat]), max_line_bytes=LINE_BYTES).dataset_format == (
        "messages"
    )
    # As OpenAI's API phrases it; and TRL's shape is not OpenAI's.
    bad_lines = [OPENAI_DPO, bad(OPENAI_DPO, non_preferred_output=None), OPENAI_DPO, TRL_EXPLICIT]
    with pytest.raises(DatasetError) as e:
        check_uploaded_file(write_jsonl(tmp_path / "bad.jsonl", bad_lines), max_line_bytes=LINE_BYTES)
    said = str(e.value)
    assert said.startswith("line 2: non_preferred_output is missing: a preference record needs two answers"), said
    assert "; line 4: the record has TRL's preference fields: OpenAI's DPO format is {\"input\"" in said
    assert [p.line for p in e.value.problems] == [2, 4]


def test_an_uploads_dpo_messages_are_held_to_openais_message_fields(tmp_path: Path) -> None:
    """As for chat uploads: a message field OpenAI's format lacks is refused, in the input's
    messages and in either answer, naming where."""
    extra_input = {**OPENAI_DPO, "input": {**OPENAI_DPO["input"], "messages": [{**USER, "mood": "curious"}]}}
    extra_answer = {**OPENAI_DPO, "non_preferred_output": [{**OPENAI_DPO["non_preferred_output"][0], "score": 2}]}
    with pytest.raises(DatasetError) as e:
        check_uploaded_file(
            write_jsonl(tmp_path / "bad.jsonl", [OPENAI_DPO, extra_input, extra_answer]), max_line_bytes=LINE_BYTES
        )
    said = str(e.value)
    assert said.startswith("line 2: input.messages[0].mood is not a field of OpenAI's chat format"), said
    assert "; line 3: non_preferred_output[0].score is not a field" in said
