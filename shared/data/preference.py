"""Preference records: two answers to one prompt, the preferred one and the other, for
preference tuning (DPO). Torch-free, as ``records`` is: the API checks them at submit and upload.

Two shapes, told apart by their fields as the SFT formats are (``records.detect_format`` names
both ``preference``; the file's first record picks the shape every other record must have):

- OpenAI's DPO fine-tuning format: ``{"input": {"messages": [...], "tools": [...]},
  "preferred_output": [...], "non_preferred_output": [...]}``, each output a list of assistant
  messages (tool calls included);
- TRL's preference format: ``{"prompt", "chosen", "rejected"}``, each text (TRL's standard
  format) or a list of messages (conversational: ``chosen`` and ``rejected`` assistant messages,
  a top-level ``tools``); or TRL's implicit prompt: no ``prompt``, and ``chosen`` and
  ``rejected`` whole conversations (or texts) that begin alike, the prompt being what they
  share: their longest common run of messages (of characters for text, split as
  ``trl.extract_prompt`` splits it: a space before the first difference goes with the answers).

Messages and tools are checked by the rules of the ``messages`` format (``records``), and each
answer must be assistant messages that say something. Both shapes become one ``PreferencePair``,
which is what ``shared.data.tokenized`` renders: the same pair in either shape trains the same.

A file of supervised records (text, prompt_completion, messages) is refused whole, with one message
naming the method (``supervised_refusal``), as an SFT job refuses a file of preference records
(``records.preference_refusal``): the ranks, the plan and the submit all read through here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shared.data.records import (
    DatasetError,
    FieldProblem,
    RecordProblem,
    SftFormat,
    answers_something,
    detect_format,
    iter_records,
    messages_problem,
    string_field_problem,
    summary,
    tools_problem,
    unknown_message_field,
)

PreferenceShape = Literal["openai", "trl"]
EXAMPLES: dict[PreferenceShape, str] = {
    "trl": '{"prompt": "...", "chosen": "...", "rejected": "..."}',
    "openai": (
        '{"input": {"messages": [{"role": "user", "content": "..."}]}, "preferred_output": [{"role": "assistant", '
        '"content": "..."}], "non_preferred_output": [{"role": "assistant", "content": "..."}]}'
    ),
}
ANSWER_EXAMPLE = '[{"role": "assistant", "content": "..."}]'
NO_FIELDS = (
    "has none of the fields of a preference record: use "
    + " (TRL's preference format), or ".join(EXAMPLES.values())
    + " (OpenAI's DPO format)"
)
IMPLICIT_PROMPT = (
    'without a "prompt" field, chosen and rejected are whole conversations (or texts) that begin alike, '
    'the prompt, and end in different answers; or give the prompt in a "prompt" field'
)

# The fields by which each SFT format is told (``records.detect_format``), as a refusal names them.
SFT_FIELDS: dict[SftFormat, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}

Conversation = list[dict[str, Any]]


@dataclass(frozen=True)
class PreferencePair:
    """One preference record in the form both shapes become: the prompt, then the preferred
    answer (``chosen``) and the other (``rejected``). Text throughout (TRL's standard format),
    or messages throughout: the prompt's conversation, each answer its assistant messages,
    with the ``tools`` the assistant was offered."""

    prompt: str | Conversation
    chosen: str | Conversation
    rejected: str | Conversation
    tools: list[dict[str, Any]] | None = None


@dataclass
class PreferenceRecords:
    """A file's preference records as pairs, each with where it came from."""

    shape: PreferenceShape
    pairs: list[PreferencePair] = field(default_factory=list)
    where: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.pairs)


def preference_shape(record: Any) -> PreferenceShape | None:
    """Which shape a record has, by its answers' fields; None for a record with neither's."""
    if not isinstance(record, dict):
        return None
    if "preferred_output" in record or "non_preferred_output" in record:
        return "openai"
    if "chosen" in record or "rejected" in record:
        return "trl"
    return None


def preference_pair(record: Any, shape: PreferenceShape) -> PreferencePair | FieldProblem:
    """The record as a pair, or the first problem that keeps it from being one."""
    if not isinstance(record, dict):
        return FieldProblem(None, f"must be a JSON object like {EXAMPLES[shape]}")
    return _openai_pair(record) if shape == "openai" else _trl_pair(record)


def openai_preference_problem(record: Any) -> FieldProblem | None:
    """What is wrong with one record of OpenAI's DPO fine-tuning format (what ``POST /v1/files``
    takes beside chat records), or None: a message field OpenAI's format lacks is refused too."""
    if preference_shape(record) == "trl":
        return FieldProblem(None, f"has TRL's preference fields: OpenAI's DPO format is {EXAMPLES['openai']}")
    found = preference_pair(record, "openai")
    if isinstance(found, FieldProblem):
        return found
    # As for chat uploads (records.openai_upload_chat_problem): only the message fields OpenAI takes.
    return (
        unknown_message_field(record["input"].get("messages"), "input.messages")
        or unknown_message_field(record.get("preferred_output"), "preferred_output")
        or unknown_message_field(record.get("non_preferred_output"), "non_preferred_output")
    )


def supervised_refusal(holder: str, evidence: str) -> str:
    """Why a DPO job refuses a file of supervised records, whole (``records.preference_refusal``
    the other way round): ``holder`` names the file, ``evidence`` says how its records show it
    (``line 1 has "messages"``)."""
    return (
        f"{holder} holds supervised records ({evidence}), for supervised fine-tuning (SFT), which a DPO job "
        f"cannot train on: a DPO job trains on preference records, like {EXAMPLES['trl']} (TRL's preference "
        f"format), or {EXAMPLES['openai']} (OpenAI's DPO format)"
    )


def _refuse_supervised(path: Path, where: str, record: Any) -> None:
    """Raise DatasetError (``supervised_refusal``) when ``record``, a file's first with a known
    format's fields, is a supervised one: the file is refused whole, never line by line."""
    found = detect_format(record)
    if found is not None and found != "preference":
        fields = " and ".join(f'"{name}"' for name in SFT_FIELDS[found])
        raise DatasetError(supervised_refusal(path.name, f"{where} has {fields}"))


def read_preference_records(path: Path, *, max_line_bytes: int) -> PreferenceRecords:
    """Every record of a file of preference records as a pair, or a DatasetError naming the bad
    ones as the SFT formats' reader does (``line 3 field "rejected" is missing: ...``). The
    shape is the first record's; a file whose first record is a supervised one (text,
    prompt_completion, messages) is refused whole, naming the method (``supervised_refusal``).
    ``max_line_bytes``: ``TUNEQ_MAX_LINE_BYTES``."""
    records: PreferenceRecords | None = None
    problems: list[RecordProblem] = []
    for where, item in iter_records(path, max_line_bytes=max_line_bytes):
        found: PreferencePair | FieldProblem = item if isinstance(item, FieldProblem) else FieldProblem(None, NO_FIELDS)
        if not isinstance(item, FieldProblem):
            if records is None:
                _refuse_supervised(path, where, item)
                if (shape := preference_shape(item)) is not None:
                    records = PreferenceRecords(shape=shape)
            if records is not None:
                found = preference_pair(item, records.shape)
        if isinstance(found, FieldProblem):
            problems.append(RecordProblem(where, found.native_text()))
        elif records is not None and not problems:  # once a record is bad, only problems are kept
            records.pairs.append(found)
            records.where.append(where)
    if problems:
        raise DatasetError(f"{path.name}: {summary([f'{p.where} {p.message}' for p in problems])}", problems)
    if records is None or not records.pairs:
        raise DatasetError(f"{path.name} has no records: add records like {EXAMPLES['trl']}")
    return records


# --- the two shapes ---------------------------------------------------------------------------


def _missing(record: dict[str, Any], *names: str) -> FieldProblem | None:
    """A field given as null counts as absent, as in every format."""
    for name in names:
        if record.get(name) is None:
            return FieldProblem(
                name, "is missing: a preference record needs two answers, the preferred one and the other"
            )
    return None


def _answers_problem(answers: Any, at: str, *, first_index: int = 0) -> FieldProblem | None:
    """An answer of a pair, at ``at``: assistant messages (tool calls included) that say
    something. ``first_index``: where they start in the record's list (an implicit prompt's)."""
    if not isinstance(answers, list) or not answers:
        return FieldProblem(at, f"must be a non-empty list of assistant messages, like {ANSWER_EXAMPLE}")
    for i, message in enumerate(answers, start=first_index):
        if isinstance(message, dict) and message.get("role") != "assistant":
            return FieldProblem(
                f"{at}[{i}].role",
                'must be "assistant": an answer is the assistant\'s turns only; what comes before is the prompt',
            )
    if (problem := messages_problem(answers, at, first_index=first_index)) is not None:
        return problem
    for i, message in enumerate(answers, start=first_index):
        if message.get("weight") is not None:
            return FieldProblem(f"{at}[{i}].weight", "is for supervised records: both answers of a pair are trained on")
    if not any(answers_something(m) for m in answers):
        return FieldProblem(at, "is empty: give the assistant's answer, as content or tool_calls")
    return None


def _same_problem(chosen: Any, rejected: Any, chosen_name: str, rejected_name: str) -> FieldProblem | None:
    if chosen == rejected:
        return FieldProblem(
            rejected_name, f"is identical to {chosen_name}: a pair's answers must differ, or there is no preference"
        )
    return None


def _openai_pair(record: dict[str, Any]) -> PreferencePair | FieldProblem:
    given: Any = record.get("input")
    problem = _missing(record, "preferred_output", "non_preferred_output")
    if problem is None and not isinstance(given, dict):
        problem = FieldProblem("input", 'must be an object like {"messages": [...], "tools": [...]}: the prompt')
    if problem is not None:
        return problem
    preferred, other = record["preferred_output"], record["non_preferred_output"]
    problem = (
        messages_problem(given.get("messages"), "input.messages")
        or tools_problem(given.get("tools"), "input.tools")
        or _answers_problem(preferred, "preferred_output")
        or _answers_problem(other, "non_preferred_output")
        or _same_problem(preferred, other, "preferred_output", "non_preferred_output")
    )
    return problem or PreferencePair(given["messages"], preferred, other, given.get("tools") or None)


def _trl_pair(record: dict[str, Any]) -> PreferencePair | FieldProblem:
    if (problem := _missing(record, "chosen", "rejected")) is not None:
        return problem
    text = isinstance(record["chosen"], str)
    if not text and not isinstance(record["chosen"], list):
        return FieldProblem("chosen", "must be text, or a list of messages (TRL's conversational format)")
    for name in ("prompt", "rejected"):
        value = record.get(name)
        if value is not None and not isinstance(value, str if text else list):
            return FieldProblem(
                name, "must be text, as chosen is" if text else "must be a list of messages, as chosen is"
            )
    if record.get("prompt") is None:
        return _implicit_text_pair(record) if text else _implicit_conversation_pair(record)
    if text:
        problem = (
            string_field_problem(record, "prompt", may_be_empty=True)
            or string_field_problem(record, "chosen")
            or string_field_problem(record, "rejected")
        )
    else:
        problem = (
            messages_problem(record["prompt"], "prompt")
            or tools_problem(record.get("tools"), "tools")
            or _answers_problem(record["chosen"], "chosen")
            or _answers_problem(record["rejected"], "rejected")
        )
    problem = problem or _same_problem(record["chosen"], record["rejected"], "chosen", "rejected")
    tools = None if text else record.get("tools") or None
    return problem or PreferencePair(record["prompt"], record["chosen"], record["rejected"], tools)


def _implicit_text_pair(record: dict[str, Any]) -> PreferencePair | FieldProblem:
    problem = (
        string_field_problem(record, "chosen")
        or string_field_problem(record, "rejected")
        or _same_problem(record["chosen"], record["rejected"], "chosen", "rejected")
    )
    if problem is not None:
        return problem
    chosen, rejected = record["chosen"], record["rejected"]
    shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b), None)
    if shared is None:  # one is the other and more: the shorter has no answer of its own
        shorter = "chosen" if len(chosen) < len(rejected) else "rejected"
        return FieldProblem(shorter, f"has no answer after the text it shares with the other: {IMPLICIT_PROMPT}")
    if shared > 0 and chosen[shared - 1] == " ":  # as trl.extract_prompt: the answers keep their space
        shared -= 1
    if shared == 0:
        return FieldProblem("chosen", f"and rejected share no beginning: {IMPLICIT_PROMPT}")
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not text[shared:].strip():
            return FieldProblem(name, f"has only blanks after the text it shares with the other: {IMPLICIT_PROMPT}")
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:])


def _implicit_conversation_pair(record: dict[str, Any]) -> PreferencePair | FieldProblem:
    chosen, rejected = record["chosen"], record["rejected"]
    problem = (
        messages_problem(chosen, "chosen")
        or messages_problem(rejected, "rejected")
        or tools_problem(record.get("tools"), "tools")
        or _same_problem(chosen, rejected, "chosen", "rejected")
    )
    if problem is not None:
        return problem
    shared = next(
        (i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b), min(len(chosen), len(rejected))
    )
    if shared == 0:
        return FieldProblem("chosen", f"and rejected share no first message: {IMPLICIT_PROMPT}")
    shared_messages = "message" if shared == 1 else f"{shared} messages"
    for name, conversation in (("chosen", chosen), ("rejected", rejected)):
        if len(conversation) == shared:
            return FieldProblem(
                name, f"has no assistant answer after the {shared_messages} it shares with the other: {IMPLICIT_PROMPT}"
            )
        if (problem := _answers_problem(conversation[shared:], name, first_index=shared)) is not None:
            return problem
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:], record.get("tools") or None)
