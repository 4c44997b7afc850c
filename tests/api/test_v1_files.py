"""OpenAI's Files API at /v1/files, in process, on SQLite and on Postgres, on a local and an S3 store.

The official SDK against a real ``tuneq dev`` is tests/e2e/test_openai_files.py; here the shapes,
limits, errors and what is left (or not) in SQL and the store are checked request by request.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, func, select

from shared.db.api_keys import create_key
from shared.db.engine import get_engine
from shared.db.models import File
from shared.settings import get_settings
from tests.conftest import clear_caches
from tests.services import S3_CREDENTIALS, LoopbackS3
from tests.shared.data.preference_records import OPENAI_DPO

CHAT = {
    "messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
        {"role": "assistant", "content": "Cold.", "weight": 0},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
}
CONTENT = "".join(json.dumps(CHAT) + "\n" for _ in range(3)).encode()
BAD_LINE_7 = b"".join(
    [json.dumps(CHAT).encode() + b"\n"] * 6
    + [b'{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}\n']
)
ENVELOPE_KEYS = {"message", "type", "param", "code"}
S3_BUCKET = "files"

StoredKeys = Callable[[], list[str]]


@pytest.fixture(scope="module")
def s3() -> Iterator[LoopbackS3]:
    server = LoopbackS3().start()
    server.client().create_bucket(Bucket=S3_BUCKET)
    yield server
    server.stop()


@pytest.fixture(params=["local", "s3"])
def stored_keys(request: pytest.FixtureRequest, database_url: str, monkeypatch: pytest.MonkeyPatch) -> StoredKeys:
    """The store this test's app uses (its default directory, or an S3 prefix), as a function
    listing what the store holds under ``files/`` (partial uploads included)."""
    if request.param == "local":
        root = get_settings().runs_dir / "files"
        return lambda: sorted(p.name for p in root.glob("*"))
    server: LoopbackS3 = request.getfixturevalue("s3")
    prefix = uuid.uuid4().hex
    for name, value in S3_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TUNEQ_ARTIFACTS_URI", f"s3://{S3_BUCKET}/{prefix}")
    monkeypatch.setenv("TUNEQ_S3_ENDPOINT_URL", server.endpoint)
    clear_caches()

    def listed() -> list[str]:
        answer = server.client().list_objects_v2(Bucket=S3_BUCKET, Prefix=f"{prefix}/files/")
        return sorted(o["Key"].rsplit("/", 1)[1] for o in answer.get("Contents", []))

    return listed


@pytest.fixture
def client(stored_keys: StoredKeys) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:
        yield c


def upload(
    client: TestClient,
    content: bytes = CONTENT,
    *,
    filename: str = "train.jsonl",
    purpose: str = "fine-tune",
    headers: dict[str, str] | None = None,
) -> Any:
    return client.post(
        "/v1/files",
        files={"file": (filename, content, "application/jsonl")},
        data={"purpose": purpose},
        headers=headers,
    )


def file_rows() -> int:
    with Session(get_engine()) as session:
        return int(session.exec(select(func.count()).select_from(File)).one())


def error_of(response: Any, status: int) -> dict[str, Any]:
    """The OpenAI error of ``response``, after checking its status and its envelope's keys."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body.keys() == {"error"} and body["error"].keys() == ENVELOPE_KEYS, body
    return dict(body["error"])


def test_a_file_is_uploaded_listed_read_back_and_deleted(client: TestClient, stored_keys: StoredKeys) -> None:
    before = int(time.time())
    created = upload(client)
    assert created.status_code == 200, created.text
    file = created.json()
    assert re.fullmatch(r"file-[A-Za-z0-9]{24}", file["id"])
    assert file == {
        "id": file["id"],
        "object": "file",
        "bytes": len(CONTENT),
        "created_at": file["created_at"],
        "filename": "train.jsonl",
        "purpose": "fine-tune",
        "status": "processed",
    }  # no expires_at or status_details: OpenAI's schema has no null for them, and lets them out
    assert before <= file["created_at"] <= time.time()  # Unix seconds
    assert stored_keys() == [file["id"]]
    assert client.get(f"/v1/files/{file['id']}").json() == file
    assert client.get("/v1/files").json() == {
        "object": "list",
        "data": [file],
        "first_id": file["id"],
        "last_id": file["id"],
        "has_more": False,
    }
    content = client.get(f"/v1/files/{file['id']}/content")
    assert content.status_code == 200 and content.content == CONTENT
    assert content.headers["content-type"] == "application/octet-stream"
    assert content.headers["content-length"] == str(len(CONTENT))

    deleted = client.delete(f"/v1/files/{file['id']}")
    assert deleted.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert stored_keys() == [] and file_rows() == 0
    for gone in (client.get(f"/v1/files/{file['id']}"), client.delete(f"/v1/files/{file['id']}")):
        assert error_of(gone, 404) == {
            "message": f"No such File object: {file['id']}",
            "type": "invalid_request_error",
            "param": "id",
            "code": "not_found",
        }
    # An empty list: no nulls, as OpenAI's schema says; an empty after= is no cursor.
    assert client.get("/v1/files", params={"after": ""}).json() == {
        "object": "list",
        "data": [],
        "first_id": "",
        "last_id": "",
        "has_more": False,
    }


def test_a_file_name_with_any_characters_comes_back_as_given(client: TestClient) -> None:
    name = "données; été (v2).jsonl"  # no '"': clients percent-encode it in the form (HTML's rule)
    file = upload(client, filename=name).json()
    assert file["filename"] == name
    disposition = client.get(f"/v1/files/{file['id']}/content").headers["content-disposition"]
    assert disposition == "attachment; filename*=UTF-8''donn%C3%A9es%3B%20%C3%A9t%C3%A9%20%28v2%29.jsonl"


@pytest.mark.parametrize(
    ("content", "purpose", "filename", "param", "said"),
    [
        (CONTENT, "assistants", "train.jsonl", "purpose", "purpose 'assistants' is not one tuneq keeps files for"),
        (BAD_LINE_7, "fine-tune", "train.jsonl", "file", "train.jsonl: line 7: messages[1].role must be one of"),
        (b"{oops\n", "fine-tune", "train.jsonl", "file", "train.jsonl: line 1: the record is not valid JSON"),
        (b"\n", "fine-tune", "train.jsonl", "file", "train.jsonl: the file has no records"),
        (b"\xff\xfe\n", "fine-tune", "train.jsonl", "file", "train.jsonl: line 1: the record is not valid UTF-8"),
        (CONTENT, "fine-tune", "x" * 256, "file", "the file's name is 256 characters long"),
    ],
)
def test_a_file_that_cannot_be_kept_is_a_400_naming_the_field_and_leaves_nothing(
    client: TestClient, stored_keys: StoredKeys, content: bytes, purpose: str, filename: str, param: str, said: str
) -> None:
    error = error_of(upload(client, content, purpose=purpose, filename=filename), 400)
    assert error["message"].startswith(said), error
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert file_rows() == 0 and stored_keys() == []


def _chat_line(**changes: Any) -> bytes:
    """CHAT as one JSON Lines line, each of ``changes`` (a field: raw JSON text) put in as written."""
    record = dict(CHAT)
    for name in changes:
        record[name] = f"__{name}__"
    line = json.dumps(record)
    for name, raw in changes.items():
        line = line.replace(f'"__{name}__"', raw)
    return line.encode() + b"\n"


GOOD_LINE = _chat_line()
USER_SAYS = json.dumps([CHAT["messages"][0], {"role": "user", "content": "h\ud800i"}, *CHAT["messages"][2:]])
# What the probe (issue 41) sent, each once a 500 (deep nesting, with the connection dropped) or a
# file accepted whose job then failed in the tokenizer (a lone surrogate, a NUL).
HOSTILE_UPLOADS = [
    (
        "nested-5000",
        GOOD_LINE + _chat_line(tools="[" * 5000 + "]" * 5000),
        "train.jsonl: line 2: the record is nested deeper than 32 levels, which no record needs: flatten it",
    ),
    (
        "nested-40",
        _chat_line(
            tools='[{"type": "function", "function": {"name": "f", "parameters": ' + "[" * 40 + "]" * 40 + "}}]"
        ),
        "train.jsonl: line 1: tools is nested deeper than 32 levels",
    ),
    (
        "lone-surrogate",
        GOOD_LINE * 2 + _chat_line(messages=USER_SAYS),
        "train.jsonl: line 3: messages[1].content contains a lone UTF-16 surrogate (such as \\ud800)",
    ),
    (
        "nul-in-a-tool-call",
        _chat_line(
            messages=json.dumps(
                [
                    {"role": "user", "content": "weather?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "a\x00"}'}}
                        ],
                    },
                ]
            )
        ),
        "train.jsonl: line 1: messages[1].tool_calls[0].function.arguments contains a NUL character (\\u0000)",
    ),
    (
        "nul-in-a-tool-schema-key",
        _chat_line(tools='[{"type": "function", "function": {"name": "w", "parameters": {"a\\u0000": 1}}}]'),
        "train.jsonl: line 1: tools[0].function.parameters has a key that contains a NUL character",
    ),
]


@pytest.mark.parametrize(("content", "said"), [c[1:] for c in HOSTILE_UPLOADS], ids=[c[0] for c in HOSTILE_UPLOADS])
def test_a_record_no_request_body_could_hold_is_a_400_naming_the_line_and_the_connection_goes_on(
    client: TestClient, stored_keys: StoredKeys, content: bytes, said: str
) -> None:
    error = error_of(upload(client, content), 400)
    assert error["message"].startswith(said), error
    assert (error["type"], error["param"]) == ("invalid_request_error", "file")
    assert file_rows() == 0 and stored_keys() == []
    # The same client's next request is answered: nothing above broke the connection or the app.
    kept = upload(client)
    assert kept.status_code == 200, kept.text
    assert stored_keys() == [kept.json()["id"]]


def test_a_line_past_max_line_bytes_is_a_400_naming_it_and_one_at_it_is_kept(
    client: TestClient, stored_keys: StoredKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = len(GOOD_LINE) - 1  # the newline aside: the good line is exactly at the limit
    monkeypatch.setenv("TUNEQ_MAX_LINE_BYTES", str(limit))
    get_settings.cache_clear()
    longer = {"role": "assistant", "content": "You are most welcome."}
    long_line = _chat_line(messages=json.dumps([*CHAT["messages"][:-1], longer]))
    assert len(long_line) > len(GOOD_LINE)
    error = error_of(upload(client, GOOD_LINE + long_line + GOOD_LINE), 400)
    assert error["message"] == (
        f"train.jsonl: line 2: the record is longer than {limit} bytes, the most one line may hold "
        "(TUNEQ_MAX_LINE_BYTES): shorten the record, or split it into several"
    )
    assert error["param"] == "file" and file_rows() == 0 and stored_keys() == []
    kept = upload(client, GOOD_LINE * 3)
    assert kept.status_code == 200, kept.text
    assert kept.json()["bytes"] == 3 * len(GOOD_LINE) and file_rows() == 1


def _dpo_lines(*records: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(record).encode() + b"\n" for record in records)


def test_an_openai_dpo_file_with_tool_calls_is_accepted_and_kept_as_preference_records(
    client: TestClient, stored_keys: StoredKeys
) -> None:
    created = upload(client, _dpo_lines(OPENAI_DPO, OPENAI_DPO, OPENAI_DPO), filename="dpo.jsonl")
    assert created.status_code == 200, created.text
    file = created.json()
    assert (file["filename"], file["status"]) == ("dpo.jsonl", "processed")
    with Session(get_engine()) as session:
        row = session.get(File, file["id"])
        assert row is not None and (row.records, row.dataset_format) == (3, "preference")
    assert stored_keys() == [file["id"]]


def _without(record: dict[str, Any], name: str) -> dict[str, Any]:
    return {key: value for key, value in record.items() if key != name}


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (_without(OPENAI_DPO, "non_preferred_output"), "line 2: non_preferred_output is missing"),
        ({**OPENAI_DPO, "preferred_output": []}, "line 2: preferred_output must be a non-empty list of assistant"),
        (
            {**OPENAI_DPO, "preferred_output": [{"role": "assistant", "content": ""}]},
            "line 2: preferred_output is empty: give the assistant's answer",
        ),
        (
            {**OPENAI_DPO, "non_preferred_output": [{"role": "user", "content": "x"}]},
            'line 2: non_preferred_output[0].role must be "assistant"',
        ),
        (
            {**OPENAI_DPO, "non_preferred_output": OPENAI_DPO["preferred_output"]},
            "line 2: non_preferred_output is identical to preferred_output",
        ),
        ({**OPENAI_DPO, "input": {"messages": []}}, "line 2: input.messages must be a non-empty list"),
        (
            {"prompt": "Who?", "chosen": "A cat.", "rejected": "A dog."},
            "line 2: the record has TRL's preference fields: OpenAI's DPO format is",
        ),
    ],
)
def test_each_bad_dpo_record_is_a_400_naming_its_line_and_leaves_nothing(
    client: TestClient, stored_keys: StoredKeys, bad: dict[str, Any], said: str
) -> None:
    error = error_of(upload(client, _dpo_lines(OPENAI_DPO, bad, OPENAI_DPO), filename="dpo.jsonl"), 400)
    assert error["message"].startswith(f"dpo.jsonl: {said}"), error
    assert (error["type"], error["param"]) == ("invalid_request_error", "file")
    assert file_rows() == 0 and stored_keys() == []


def test_the_bad_record_message_names_line_7_and_the_field_in_full(client: TestClient) -> None:
    error = error_of(upload(client, BAD_LINE_7), 400)
    assert error["message"] == (
        "train.jsonl: line 7: messages[1].role must be one of system, developer, user, assistant, tool"
    )


def test_missing_form_fields_and_bad_parameters_are_400s_never_422(client: TestClient) -> None:
    no_purpose = client.post("/v1/files", files={"file": ("t.jsonl", CONTENT)})
    assert error_of(no_purpose, 400)["param"] == "purpose"
    assert error_of(no_purpose, 400)["message"] == "field purpose: Field required"
    no_file = client.post("/v1/files", data={"purpose": "fine-tune"})
    assert error_of(no_file, 400)["param"] == "file"
    not_a_form = client.post("/v1/files", json={"purpose": "fine-tune"})
    assert error_of(not_a_form, 400)["type"] == "invalid_request_error"
    for params, param in [({"limit": 0}, "limit"), ({"limit": 10_001}, "limit"), ({"order": "up"}, "order")]:
        error = error_of(client.get("/v1/files", params=params), 400)
        assert error["param"] == param and error["message"].startswith(f"query parameter {param}: "), error
    assert file_rows() == 0
    # The native API keeps FastAPI's own shapes.
    native = client.get("/jobs", params={"limit": 0})
    assert native.status_code == 422 and native.json()["detail"][0]["loc"] == ["query", "limit"]


def test_unknown_v1_paths_and_methods_answer_in_the_envelope(client: TestClient) -> None:
    assert "is not a route" in error_of(client.get("/v1/batches"), 404)["message"]
    not_allowed = client.put("/v1/files")
    assert error_of(not_allowed, 405)["message"] == "/v1/files does not take PUT"
    assert not_allowed.headers["allow"] == "GET, POST"  # both routes' methods, not only the first's
    assert client.put("/v1/files/file-x").headers["allow"] == "DELETE, GET"
    assert client.get("/no-such-path").json() == {"detail": "Not Found"}


@pytest.mark.parametrize("file_id", ["file-nope", "file-" + "a" * 24, "file-%00" + "a" * 23, "x" * 300, "file-ä"])
def test_an_id_tuneq_never_made_is_not_found(client: TestClient, file_id: str) -> None:
    # A NUL can be in no id: refused before any route (api.nul_refusal), as a malformed path.
    status, param = (400, None) if "%00" in file_id else (404, "id")
    for method, suffix in [("GET", ""), ("GET", "/content"), ("DELETE", "")]:
        assert error_of(client.request(method, f"/v1/files/{file_id}{suffix}"), status)["param"] == param
    assert error_of(client.get("/v1/files", params={"after": file_id}), 400)["param"] == "after"


def test_files_are_listed_a_page_at_a_time_in_either_order(client: TestClient) -> None:
    ids = [upload(client, filename=f"{n}.jsonl").json()["id"] for n in range(3)]

    def page(**params: Any) -> dict[str, Any]:
        answer = client.get("/v1/files", params=params)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    newest_first = list(reversed(ids))
    assert [f["id"] for f in page()["data"]] == newest_first
    first = page(limit=2)
    assert [f["id"] for f in first["data"]] == newest_first[:2] and first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (newest_first[0], newest_first[1])
    rest = page(limit=2, after=first["last_id"])
    assert [f["id"] for f in rest["data"]] == newest_first[2:] and rest["has_more"] is False
    assert [f["id"] for f in page(order="asc", limit=2)["data"]] == ids[:2]
    assert [f["id"] for f in page(order="asc", after=ids[1])["data"]] == ids[2:]
    assert len(page(purpose="fine-tune")["data"]) == 3
    assert page(purpose="batch") == {"object": "list", "data": [], "first_id": "", "last_id": "", "has_more": False}
    assert page(after=newest_first[-1])["data"] == []


def test_a_file_past_max_upload_bytes_is_413_and_one_at_it_is_kept(
    client: TestClient, stored_keys: StoredKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = json.dumps(CHAT).encode() + b"\n"
    exactly = line + b" " * (2000 - len(line) - 1) + b"\n"  # trailing blank lines are skipped
    assert len(exactly) == 2000
    monkeypatch.setenv("TUNEQ_MAX_UPLOAD_BYTES", "2000")
    get_settings.cache_clear()
    kept = upload(client, exactly)
    assert kept.status_code == 200 and kept.json()["bytes"] == 2000, kept.text
    # One byte more: within the request's limit (the file plus TUNEQ_MAX_REQUEST_BYTES for the
    # form), so the route refuses it as it copies the file.
    error = error_of(upload(client, exactly + b"\n"), 413)
    assert error["param"] == "file"
    assert error["message"].startswith("the file is larger than 2000 bytes, the most tuneq takes (TUNEQ_MAX_UPLOAD")
    assert file_rows() == 1 and stored_keys() == [kept.json()["id"]]


def test_a_body_past_the_upload_limit_is_413_before_it_is_read(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNEQ_MAX_UPLOAD_BYTES", "2000")
    monkeypatch.setenv("TUNEQ_MAX_REQUEST_BYTES", "1000")
    get_settings.cache_clear()
    body = b"x" * 3500
    headers = {"content-type": "multipart/form-data; boundary=b"}
    said = "the request body is larger than 3000 bytes: a file may be at most 2000 bytes (TUNEQ_MAX_UPLOAD_BYTES)"
    assert error_of(client.post("/v1/files", content=body, headers=headers), 413)["message"] == said
    chunked = client.post("/v1/files", content=iter([body[:2000], body[2000:]]), headers=headers)
    assert error_of(chunked, 413)["message"] == said
    # Every other request keeps TUNEQ_MAX_REQUEST_BYTES, and the native API its own shape.
    assert "TUNEQ_MAX_REQUEST_BYTES" in error_of(client.post("/v1/files/x", content=body[:1500]), 413)["message"]
    native = client.post("/jobs", content=body[:1500], headers={"content-type": "application/json"})
    assert native.status_code == 413 and "TUNEQ_MAX_REQUEST_BYTES" in native.json()["detail"]
    assert file_rows() == 0


def test_a_failed_commit_removes_the_stored_bytes(
    client: TestClient, stored_keys: StoredKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row is committed after the store has the bytes; when the commit fails, the bytes go."""

    def refuse(self: Session) -> None:
        raise RuntimeError("the database refused the commit")

    monkeypatch.setattr(Session, "commit", refuse)
    with pytest.raises(RuntimeError, match="refused the commit"):
        upload(client)
    monkeypatch.undo()
    assert stored_keys() == [] and file_rows() == 0


def test_a_database_outage_is_a_503_with_retry_after_in_each_apis_shape(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy.exc import OperationalError

    from api.routes import jobs
    from api.v1 import files_service

    def unreachable(**_: Any) -> Any:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(files_service, "list_files", unreachable)
    monkeypatch.setattr(jobs.jobs_service, "list_jobs", unreachable)
    v1 = client.get("/v1/files")
    assert error_of(v1, 503)["type"] == "server_error" and v1.headers["retry-after"] == "5"
    native = client.get("/jobs")
    assert native.status_code == 503 and native.headers["retry-after"] == "5"
    assert native.json() == {"detail": error_of(v1, 503)["message"]}


# ---- owners ---------------------------------------------------------------------------


def key_of(owner: str) -> dict[str, str]:
    with Session(get_engine()) as session:
        return {"Authorization": f"Bearer {create_key(session=session, owner=owner)[1]}"}


@pytest.fixture
def keyed_client(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    from api.main import create_app

    monkeypatch.setenv("TUNEQ_AUTH", "on")
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        yield c


def test_without_a_valid_key_every_files_route_is_401_in_the_envelope(keyed_client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer tq_nope_nope"}, {"Authorization": "Basic x"}):
        for method, path in [("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/file-x/content")]:
            answer = keyed_client.request(method, path, headers=headers)
            error = error_of(answer, 401)
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key"), error
            assert answer.headers["www-authenticate"].startswith("Bearer")
    assert file_rows() == 0


def test_another_owners_file_is_not_found_exactly_like_a_missing_one(keyed_client: TestClient) -> None:
    alice, bob = key_of("alice"), key_of("bob")
    file = upload(keyed_client, headers=alice).json()
    missing = "file-" + "Z" * 24
    for method, suffix in [("GET", ""), ("GET", "/content"), ("DELETE", "")]:
        theirs = keyed_client.request(method, f"/v1/files/{file['id']}{suffix}", headers=bob)
        nothing = keyed_client.request(method, f"/v1/files/{missing}{suffix}", headers=bob)
        assert error_of(theirs, 404) == {**error_of(nothing, 404), "message": f"No such File object: {file['id']}"}
    assert keyed_client.get("/v1/files", headers=bob).json()["data"] == []
    assert error_of(keyed_client.get("/v1/files", headers=bob, params={"after": file["id"]}), 400)["param"] == "after"
    # Still alice's, whole.
    assert keyed_client.get(f"/v1/files/{file['id']}/content", headers=alice).content == CONTENT
    assert [f["id"] for f in keyed_client.get("/v1/files", headers=alice).json()["data"]] == [file["id"]]


def test_the_files_routes_are_in_the_openapi_document_with_a_key_and_no_422(tuneq_home: Path) -> None:
    from api.main import create_app

    paths = TestClient(create_app()).get("/openapi.json").json()["paths"]
    operations = [(p, m, op) for p, ops in paths.items() if p.startswith("/v1/files") for m, op in ops.items()]
    assert {(p, m) for p, m, _ in operations} == {
        ("/v1/files", "post"),
        ("/v1/files", "get"),
        ("/v1/files/{file_id}", "get"),
        ("/v1/files/{file_id}", "delete"),
        ("/v1/files/{file_id}/content", "get"),
    }
    for path, method, operation in operations:
        assert operation["security"] == [{"HTTPBearer": []}], (path, method)
        assert "422" not in operation["responses"] and "4XX" in operation["responses"], (path, method)
