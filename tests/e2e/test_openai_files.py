"""The unmodified official ``openai`` SDK against a real ``tuneq dev``: OpenAI's Files API at /v1.

What a team moving off OpenAI runs: ``OpenAI(base_url=".../v1", api_key=<a tuneq key>)`` and
``client.files``, unchanged. API keys are on, so two owners see only their own files.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from .harness import Tuneq

pytestmark = pytest.mark.slow

WEATHER_CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
# A system message, a tool call (content null) and its result, and a turn not trained on (weight 0).
CHAT = {
    "messages": [
        {"role": "system", "content": "You are a terse weather bot."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "weight": 0},
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'},
        {"role": "assistant", "content": "3 degrees, cold.", "weight": 1},
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
}


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return {"TUNEQ_AUTH": "on"}  # on loopback too: the SDK sends its api_key as a Bearer key


def sdk(service: Tuneq, key: str) -> OpenAI:
    # No retries: a refusal must surface as the exception it is, at once.
    return OpenAI(base_url=f"http://127.0.0.1:{service.port}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def alice(service: Tuneq) -> OpenAI:
    return sdk(service, service.create_key("alice"))


@pytest.fixture(scope="module")
def bob(service: Tuneq) -> OpenAI:
    return sdk(service, service.create_key("bob"))


def chat_file(path: Path, records: int = 8, *, line_7: str | None = None) -> Path:
    lines = [json.dumps(CHAT)] * records
    if line_7 is not None:
        lines[6] = line_7
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_the_sdk_uploads_lists_reads_back_and_deletes_a_chat_file(alice: OpenAI, tmp_path: Path) -> None:
    path = chat_file(tmp_path / "weather.jsonl")
    with path.open("rb") as f:
        created = alice.files.create(file=f, purpose="fine-tune")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.filename, created.purpose, created.bytes) == ("weather.jsonl", "fine-tune", path.stat().st_size)
    assert created.status == "processed" and created.created_at > 1_700_000_000
    assert alice.files.retrieve(created.id) == created
    assert alice.files.content(created.id).read() == path.read_bytes()

    # A second file, then the SDK's own paging (limit 1, following has_more with after=<last id>).
    with chat_file(tmp_path / "more.jsonl", 3).open("rb") as f:
        second = alice.files.create(file=f, purpose="fine-tune")
    ours = {created.id, second.id}
    paged = [file.id for file in alice.files.list(limit=1) if file.id in ours]
    assert paged == [second.id, created.id]  # newest first
    ascending = [file.id for file in alice.files.list(purpose="fine-tune", order="asc") if file.id in ours]
    assert ascending == [created.id, second.id]

    deleted = alice.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError) as gone:
        alice.files.retrieve(created.id)
    assert gone.value.param == "id" and created.id in gone.value.message
    assert created.id not in {file.id for file in alice.files.list()}


def test_a_malformed_line_7_is_a_bad_request_naming_it(alice: OpenAI, tmp_path: Path) -> None:
    bad = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]})
    with chat_file(tmp_path / "bad.jsonl", line_7=bad).open("rb") as f, pytest.raises(openai.BadRequestError) as e:
        alice.files.create(file=f, purpose="fine-tune")
    assert "line 7: messages[1].role must be one of system, developer, user, assistant, tool" in e.value.message
    assert (e.value.type, e.value.param) == ("invalid_request_error", "file")
    assert "bad.jsonl" not in {file.filename for file in alice.files.list()}  # nothing kept


def test_another_owners_file_is_not_found(alice: OpenAI, bob: OpenAI, tmp_path: Path) -> None:
    with chat_file(tmp_path / "alices.jsonl").open("rb") as f:
        file = alice.files.create(file=f, purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(file.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(file.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.delete(file.id)
    assert file.id not in {f.id for f in bob.files.list()}
    assert alice.files.retrieve(file.id) == file  # bob's delete removed nothing


def test_an_unknown_key_is_an_authentication_error(service: Tuneq) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        sdk(service, "tq_unknown_key").files.list()
    assert e.value.code == "invalid_api_key"
