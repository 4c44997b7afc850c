"""The HTTP client (cli.api_client): its settings, its errors, short ids and the job-event
stream, against a scripted server (tests/cli/fake_api.py) or the real API."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource

from cli.api_client import (
    EXIT_API_ERROR,
    EXIT_UNREACHABLE,
    SUBMIT,
    AmbiguousJobId,
    ApiError,
    ClientError,
    ClientSettings,
    NotTuneqApi,
    ServerUnreachable,
    TuneqClient,
    UnknownJob,
    describe_error,
    server_url,
)
from shared.ports import free_port
from tests.cli.fake_api import JOB_ID, STREAM, FakeApi, client_for, invoke, job, metric, sse
from tests.cli.served_api import ServedApi, add_job

# ---- settings and errors --------------------------------------------------------------------


def test_settings_come_from_the_environment() -> None:
    assert ClientSettings.from_env({}) == ClientSettings(url="http://127.0.0.1:8000", api_key=None)
    assert ClientSettings.from_env({"TUNEQ_URL": "https://tuneq.example/ ", "TUNEQ_API_KEY": " "}) == ClientSettings(
        url="https://tuneq.example", api_key=None
    )
    assert ClientSettings.from_env({"TUNEQ_API_KEY": "k1"}).api_key == "k1"


def test_a_url_without_a_scheme_is_http() -> None:
    assert server_url("127.0.0.1:18300") == "http://127.0.0.1:18300"
    assert server_url(" localhost:8000/ ") == "http://localhost:8000"
    assert server_url("tuneq.internal") == "http://tuneq.internal"
    for bad in ("ftp://tuneq.example", "http://", "https:///jobs"):
        with pytest.raises(ClientError, match="is not the URL of a tuneq server: give http://HOST:PORT"):
            server_url(bad)


def test_the_commands_take_a_url_without_a_scheme(api: FakeApi) -> None:
    api.json("GET", "/jobs", {"data": [job("queued")], "count": 1})
    listed = invoke(api.url.removeprefix("http://"), "jobs")
    assert listed.exit_code == 0, listed.output
    assert JOB_ID in listed.stdout
    refused = invoke("ftp://127.0.0.1:1", "jobs")
    assert refused.exit_code == 1 and "TUNEQ_URL='ftp://127.0.0.1:1' is not the URL of a tuneq server" in refused.stderr


def test_a_url_with_a_path_is_told_it_does_not_point_at_the_api(served_api: ServedApi) -> None:
    wrong = invoke(f"{served_api.url}/api", "jobs")
    assert wrong.exit_code == EXIT_API_ERROR, wrong.output
    assert wrong.stderr.strip() == (
        f"tuneq: TUNEQ_URL={served_api.url}/api does not point at a tuneq API: GET /api/jobs is not a route "
        f"there (404); drop '/api': tuneq's routes are at the server's root ({served_api.url})"
    )
    shown = invoke(f"{served_api.url}/api", "show", served_api.job_id)
    assert shown.exit_code == EXIT_API_ERROR and "does not point at a tuneq API" in shown.stderr


def test_another_service_at_the_url_is_told_it_is_not_the_api(api: FakeApi) -> None:
    def page(h: Any) -> None:
        data = b"<html>a dashboard</html>"
        h.send_response(200)
        h.send_header("Content-Type", "text/html")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    api.route("GET", "/jobs", page)
    with client_for(api) as client, pytest.raises(NotTuneqApi) as raised:
        client.list_jobs()
    assert raised.value.message == (
        f"TUNEQ_URL={api.url} does not point at a tuneq API: GET /jobs answered 200 with text/html, not JSON; "
        "check the host and port"
    )
    assert raised.value.exit_code == EXIT_API_ERROR


def _response(status: int, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers, request=httpx.Request("GET", "http://x/jobs"))


@pytest.mark.parametrize(
    ("status", "body", "headers", "key", "expected"),
    [
        (401, {"detail": "invalid API key"}, None, True, "refused the API key in TUNEQ_API_KEY (401"),
        (401, {"detail": "missing API key"}, None, False, "wants an API key (401 unauthorized): set TUNEQ_API_KEY"),
        (403, {"detail": "read-only key"}, None, True, "forbidden (403): this API key may not do that: read-only key"),
        (404, {"detail": f"job {JOB_ID} not found"}, None, False, f"not found (404): job {JOB_ID} not found"),
        (409, {"detail": "job already succeeded"}, None, False, "conflict (409): job already succeeded"),
        (
            429,
            {"detail": "slow down"},
            {"Retry-After": "7"},
            False,
            "too many requests (429): slow down; retry after 7 s",
        ),
        (500, {"detail": "boom"}, None, False, "the server answered 500 Internal Server Error: boom"),
    ],
)
def test_error_messages(status: int, body: Any, headers: dict[str, str] | None, key: bool, expected: str) -> None:
    assert expected in describe_error(_response(status, body, headers), api_key_set=key)


def test_422_names_each_field_and_its_fix() -> None:
    detail = [
        {
            "type": "value_error",
            "loc": ["body", "deepspeed_config", "gradient_acumulation_steps"],
            "msg": "did you mean x?",
        },
        {"type": "missing", "loc": ["body", "model"], "msg": "Field required"},
    ]
    message = describe_error(_response(422, {"detail": detail}), api_key_set=False, action=SUBMIT)
    assert message.splitlines() == [
        "the server refused the job (422):",
        "  body.deepspeed_config.gradient_acumulation_steps: did you mean x?",
        "  body.model: Field required",
    ]


def test_a_refused_read_says_what_failed_not_that_a_job_was_refused() -> None:
    detail = [{"type": "uuid_parsing", "loc": ["path", "job_id"], "msg": "Input should be a valid UUID"}]
    message = describe_error(_response(422, {"detail": detail}), api_key_set=False, action="read job 26a8e187")
    assert message.splitlines() == ["could not read job 26a8e187 (422):", "  path.job_id: Input should be a valid UUID"]
    assert "refused the job" not in describe_error(_response(422, {"detail": detail}), api_key_set=False)


def test_a_refused_read_through_the_client_names_the_read(api: FakeApi) -> None:
    detail = [{"type": "value_error", "loc": ["query", "tail"], "msg": "too many"}]
    api.json("GET", f"/jobs/{JOB_ID}/logs", {"detail": detail}, status=422)
    logs = invoke(api, "logs", JOB_ID)
    assert logs.exit_code == EXIT_API_ERROR
    assert f"tuneq: could not read job {JOB_ID}'s log (422):\n  query.tail: too many" in logs.stderr
    assert "refused the job" not in logs.stderr


def test_the_servers_advice_names_the_command_not_the_route() -> None:
    detail = (
        f"job {JOB_ID} is running; only a paused job can be resumed (POST /jobs/{JOB_ID}/pause pauses a queued "
        "or running one)"
    )
    message = describe_error(_response(409, {"detail": detail}), api_key_set=False, action=f"resume job {JOB_ID}")
    assert message == (
        f"conflict (409): job {JOB_ID} is running; only a paused job can be resumed (`tuneq pause {JOB_ID}` "
        "pauses a queued or running one)"
    )


def test_a_non_json_error_body_is_shown_as_text() -> None:
    response = httpx.Response(502, text="Bad Gateway from the proxy\n", request=httpx.Request("GET", "http://x/"))
    assert describe_error(response, api_key_set=False).endswith("Bad Gateway from the proxy")


def test_the_api_key_is_sent_as_a_bearer_token(api: FakeApi) -> None:
    api.json("GET", f"/jobs/{JOB_ID}", job())
    with client_for(api, api_key="secret-key") as client:
        assert client.get_job(JOB_ID)["id"] == JOB_ID
    with client_for(api) as client:
        client.get_job(JOB_ID)
    first, second = api.requests
    assert first["headers"]["Authorization"] == "Bearer secret-key"
    assert "Authorization" not in second["headers"]


def test_api_errors_raise_with_the_exit_code(api: FakeApi) -> None:
    api.json("GET", f"/jobs/{JOB_ID}", {"detail": "invalid API key"}, status=401)
    with client_for(api, api_key="bad") as client, pytest.raises(ApiError) as raised:
        client.get_job(JOB_ID)
    assert raised.value.status_code == 401 and raised.value.exit_code == EXIT_API_ERROR
    assert "TUNEQ_API_KEY" in raised.value.message


def test_connection_refused_asks_whether_the_server_runs() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with TuneqClient(ClientSettings(url=url)) as client, pytest.raises(ServerUnreachable) as raised:
        client.list_jobs()
    assert f"is `tuneq serve` running at {url}?" in raised.value.message
    assert raised.value.exit_code == EXIT_UNREACHABLE


# ---- SSE ----------------------------------------------------------------------------------


def test_sse_parsing() -> None:
    """What stream_events relies on from httpx-sse: multi-line data joined, comments skipped, and
    a message cut off by a dropped connection never dispatched (the reconnect gets it whole)."""
    lines = [
        ": ping - 2026-12-02 10:00:00",
        "",
        "id: 1",
        "event: status",
        "data: {",
        'data: "a": 1}',
        "",
        "retry: 1000",
        "data:no-space",
        "",
        ": ping",
        "",
        "id: 3",
        "data: cut off by a dropped connection",
    ]
    body = "\r\n".join(lines).encode()
    response = httpx.Response(200, headers={"Content-Type": "text/event-stream"}, content=body)
    messages = [(m.event, m.data, m.id) for m in EventSource(response).iter_sse() if m.data]
    assert messages == [("status", '{\n"a": 1}', "1"), ("message", "no-space", "1")]


def test_events_stream_until_the_terminal_status(api: FakeApi) -> None:
    api.sse(
        STREAM,
        [
            b": ping\r\n\r\n",
            sse(1, "status", {"status": "running", "attempt": 1}),
            sse(2, "metric", metric(1, 1)) + sse(3, "status", {"status": "succeeded", "error": None}),
            sse(4, "log", {"line": "never read: the stream ends at the terminal status"}),
        ],
    )
    with client_for(api) as client:
        events = list(client.stream_events(JOB_ID))
    assert [(e.id, e.type) for e in events] == [(1, "status"), (2, "metric"), (3, "status")]
    assert events[-1].terminal_status == "succeeded"
    (request,) = api.stream_requests(STREAM)
    assert request["headers"]["Accept"] == "text/event-stream" and "Last-Event-ID" not in request["headers"]


def test_a_dropped_stream_reconnects_with_last_event_id(api: FakeApi) -> None:
    api.sse(
        STREAM,
        # The connection drops in the middle of event 3: it must come again, whole, and once.
        [
            sse(1, "status", {"status": "running"}),
            sse(2, "metric", metric(1, 1)),
            sse(3, "metric", metric(2, 2))[:25],
            None,
        ],
        # A server that ends the body cleanly before the job ended: reconnect too.
        [sse(3, "metric", metric(2, 2))],
        [
            sse(4, "metric", metric(3, 3)),
            sse(5, "status", {"status": "failed", "error": {"code": "x", "message": "y"}}),
        ],
    )
    sleeps: list[float] = []
    with client_for(api) as client:
        events = list(client.stream_events(JOB_ID, sleep=sleeps.append))
    assert [e.id for e in events] == [1, 2, 3, 4, 5]
    requests = api.stream_requests(STREAM)
    assert [r["headers"].get("Last-Event-ID") for r in requests] == [None, "2", "3"]
    assert len(sleeps) == 2


def test_a_stream_that_resumes_after_the_end_stops(api: FakeApi) -> None:
    api.sse(STREAM, [])  # the job ended before the cursor: the server sends nothing and ends
    api.json("GET", f"/jobs/{JOB_ID}", job("succeeded"))
    with client_for(api) as client:
        assert list(client.stream_events(JOB_ID, after=9)) == []
    assert api.stream_requests(STREAM)[0]["headers"]["Last-Event-ID"] == "9"


def test_a_stream_that_never_comes_back_gives_up(api: FakeApi) -> None:
    api.sse(STREAM, [sse(1, "status", {"status": "running"}), None])
    with client_for(api, reconnect_for=0.3) as client:
        stream = client.stream_events(JOB_ID, sleep=lambda _s: None)
        assert next(stream).id == 1
        api.server.shutdown()
        api.server.server_close()
        with pytest.raises(ServerUnreachable, match="lost the event stream"):
            next(stream)


def test_a_missing_job_fails_the_stream_at_once(api: FakeApi) -> None:
    with client_for(api) as client, pytest.raises(ApiError) as raised:
        list(client.stream_events(JOB_ID))
    assert raised.value.status_code == 404


# ---- short ids ----------------------------------------------------------------------------


def test_a_short_id_names_the_one_job_it_starts(served_api: ServedApi) -> None:
    first = add_job(uuid.UUID("26a8e187-0000-4000-8000-000000000001"), name="first")
    second = add_job(uuid.UUID("26a8e187-1111-4000-8000-000000000002"), name="second")
    with TuneqClient(ClientSettings(url=served_api.url)) as client:
        assert client.resolve_job_id("26a8e1871") == second
        assert client.resolve_job_id("26A8E187-0") == first  # any case, with the id's dashes
        assert client.resolve_job_id(first.replace("-", "")) == first  # a whole id goes as it is
        assert client.resolve_job_id(served_api.job_id[:8]) == served_api.job_id
        with pytest.raises(AmbiguousJobId) as ambiguous:
            client.resolve_job_id("26a8e187")
        assert ambiguous.value.message == (
            f"26a8e187 starts the ids of 2 jobs: {second} (second), {first} (first); give more of the id"
        )
        assert ambiguous.value.exit_code == 2
        unknown_prefix = "0" if not served_api.job_id.startswith("0") else "1"
        with pytest.raises(UnknownJob, match=f"no job of yours has an id that starts with {unknown_prefix}0000"):
            client.resolve_job_id(f"{unknown_prefix}0000")
        with pytest.raises(UnknownJob, match="'sft' is not a job id: give the id, or its first characters"):
            client.resolve_job_id("sft")
    lookups = [r for r in served_api.recorder.requests if r["path"] == "/jobs/lookup"]
    assert len(lookups) == 5  # the whole id and the name asked nothing


@pytest.mark.parametrize("command", ["show", "logs", "cancel", "pause", "resume", "download"])
def test_every_command_takes_a_short_id(served_api: ServedApi, command: str, tmp_path: Any) -> None:
    short = served_api.job_id[:8]
    args = [command, short] + (["--output", str(tmp_path / "out")] if command == "download" else [])
    result = invoke(served_api.url, *args)
    job_paths = [r["path"] for r in served_api.recorder.requests if r["path"].startswith(f"/jobs/{served_api.job_id}")]
    assert job_paths, result.output  # the command asked for the job by its whole id
    assert "valid UUID" not in result.output and "refused the job" not in result.output
    if command in ("show", "logs"):
        assert result.exit_code == 0, result.output
    elif command == "download":  # the job has no checkpoint: told so, by its whole id's listing
        assert "the job has no model or adapter checkpoint" in result.stderr
    else:  # the job succeeded already: the server's answer for that job
        assert f"conflict (409): job {served_api.job_id} already succeeded" in result.stderr, result.output


def test_an_ambiguous_or_unknown_short_id_is_told(served_api: ServedApi) -> None:
    add_job(uuid.UUID("abcdef01-0000-4000-8000-000000000001"))
    add_job(uuid.UUID("abcdef02-0000-4000-8000-000000000002"))
    ambiguous = invoke(served_api.url, "show", "abcdef0")
    assert ambiguous.exit_code == 2 and "tuneq: abcdef0 starts the ids of 2 jobs: abcdef02-" in ambiguous.stderr
    missing = invoke(served_api.url, "cancel", "abcdef03")
    assert missing.exit_code == EXIT_API_ERROR
    assert missing.stderr == "tuneq: no job of yours has an id that starts with abcdef03 (`tuneq jobs` lists them)\n"
