"""The command-line client without a tuneq service: a real local HTTP server in a thread
serves canned answers and canned Server-Sent Events (including a dropped connection)."""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource
from typer.testing import CliRunner

from cli.client import (
    EXIT_API_ERROR,
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    ApiError,
    ClientError,
    ClientSettings,
    FollowState,
    JobEvent,
    ServerUnreachable,
    TuneqClient,
    copy_checkpoint,
    describe_error,
    exit_code_for,
    follow_job,
    format_duration,
    pick_checkpoint,
)
from cli.main import app
from shared.ports import free_port

JOB_ID = "6f1c2a8e-1b2c-4d5e-8f90-123456789abc"

# ---- a local HTTP server with scripted routes ------------------------------------------------

Route = Callable[["Handler"], None]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: FakeApi

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _serve(self) -> None:
        path, _, query = self.path.partition("?")
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        self.api.requests.append(
            {"method": self.command, "path": path, "query": query, "headers": dict(self.headers), "body": body}
        )
        route = self.api.routes.get((self.command, path))
        if route is None:
            send_json(self, 404, {"detail": f"no route {self.command} {path}"})
        else:
            route(self)

    do_GET = _serve
    do_POST = _serve

    def chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class FakeApi:
    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.requests: list[dict[str, Any]] = []
        handler = type("BoundHandler", (Handler,), {"api": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def route(self, method: str, path: str, route: Route) -> None:
        self.routes[(method, path)] = route

    def json(self, method: str, path: str, body: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.route(method, path, lambda h: send_json(h, status, body, headers))

    def sse(self, path: str, *responses: list[bytes | None]) -> None:
        """Each request to ``path`` gets the next response: chunks of SSE text; a ``None``
        chunk cuts the connection there, mid-body, as a dropped connection does."""
        pending = list(responses)

        def serve(h: Handler) -> None:
            chunks = pending.pop(0) if pending else []
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            for data in chunks:
                if data is None:
                    h.close_connection = True
                    return
                h.chunk(data)
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()

        self.route("GET", path, serve)

    def stream_requests(self, path: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"] == path]


def send_json(h: BaseHTTPRequestHandler, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    for name, value in (headers or {}).items():
        h.send_header(name, value)
    h.end_headers()
    h.wfile.write(data)


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def client_for(api: FakeApi, *, api_key: str | None = None, reconnect_for: float = 5.0) -> TuneqClient:
    return TuneqClient(ClientSettings(url=api.url, api_key=api_key), reconnect_for=reconnect_for)


def sse(event_id: int, type: str, data: dict[str, Any]) -> bytes:
    body = {"id": event_id, "type": type, "data": data, "created_at": "2026-12-02T10:00:00Z"}
    return f"id: {event_id}\r\nevent: {type}\r\ndata: {json.dumps(body)}\r\n\r\n".encode()


def job(status: str = "running", **fields: Any) -> dict[str, Any]:
    return {
        "id": JOB_ID,
        "name": "sft",
        "status": status,
        "model": "/srv/models/tiny-gpt-neo",
        "dataset": "/srv/data/train.jsonl",
        "num_gpus": 1,
        "training": {"max_steps": 4},
        "created_at": "2026-12-02T10:00:00Z",
        "started_at": None,
        "finished_at": None,
        "step": 0,
        "total_steps": None,
        "epoch": None,
        "tokens_seen": 0,
        "eta_seconds": None,
        "latest_metrics": None,
        "error": None,
        "attempts": 1,
        "max_restarts": 2,
        **fields,
    }


def metric(step: int, second: int, loss: float = 2.5) -> dict[str, Any]:
    return {"step": step, "loss": loss, "tokens_per_second": 1500.0, "time": f"2026-12-02T10:00:{second:02d}Z"}


STREAM = f"/jobs/{JOB_ID}/events/stream"


# ---- settings and errors --------------------------------------------------------------------


def test_settings_come_from_the_environment() -> None:
    assert ClientSettings.from_env({}) == ClientSettings(url="http://127.0.0.1:8000", api_key=None)
    assert ClientSettings.from_env({"TUNEQ_URL": "https://tuneq.example/ ", "TUNEQ_API_KEY": " "}) == ClientSettings(
        url="https://tuneq.example", api_key=None
    )
    assert ClientSettings.from_env({"TUNEQ_API_KEY": "k1"}).api_key == "k1"


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
    message = describe_error(_response(422, {"detail": detail}), api_key_set=False)
    assert message.splitlines() == [
        "the server refused the job (422):",
        "  body.deepspeed_config.gradient_acumulation_steps: did you mean x?",
        "  body.model: Field required",
    ]


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


# ---- following ---------------------------------------------------------------------------------


def _event(event_id: int, type: str, data: dict[str, Any]) -> JobEvent:
    return JobEvent(id=event_id, type=type, data=data)


def test_follow_state_lines_and_eta() -> None:
    state = FollowState.from_job(job("queued"))
    lines = [
        state.apply(_event(1, "status", {"status": "running", "attempt": 1})),
        state.apply(_event(2, "plan", {"total_steps": 4, "world_size": 2})),
        state.apply(_event(3, "metric", metric(1, 10, loss=3.0))),
        state.apply(_event(4, "metric", metric(2, 12, loss=2.0))),
        state.apply(_event(5, "log", {"line": "rank 0 says hi"})),
        state.apply(_event(6, "checkpoint", {"kind": "model", "step": 2, "uri": "/runs/x/model"})),
        state.apply(_event(7, "status", {"status": "succeeded", "error": None})),
    ]
    assert lines == [
        "running (attempt 1)",
        "plan: 4 steps on 2 rank(s)",
        "step 1/4 loss 3.0000 1500 tok/s eta ?",
        "step 2/4 loss 2.0000 1500 tok/s eta 4s",  # 2 s per step, 2 steps to go
        None,
        "checkpoint model at step 2: /runs/x/model",
        None,
    ]
    assert state.outcome_line() == f"job {JOB_ID} succeeded at step 2/4 (loss 2.0000)"


def test_outcomes_and_exit_codes() -> None:
    failed = FollowState.from_job(
        job("failed", step=3, total_steps=8, error={"code": "training_error", "message": "OOM"})
    )
    assert failed.outcome_line() == f"job {JOB_ID} failed at step 3/8: training_error: OOM"
    assert FollowState.from_job(job("cancelled", step=3)).outcome_line() == f"job {JOB_ID} cancelled at step 3/?"
    assert [exit_code_for(s) for s in ("succeeded", "failed", "cancelled")] == [0, EXIT_FAILED, EXIT_CANCELLED]
    assert [format_duration(s) for s in (None, 4.4, 75, 3 * 3600 + 120)] == ["?", "4s", "1m15s", "3h02m"]


def test_the_live_progress_bar_draws_and_returns_the_final_job(api: FakeApi) -> None:
    from rich.console import Console

    api.sse(
        STREAM,
        [
            sse(1, "plan", {"total_steps": 2, "world_size": 1}),
            sse(2, "metric", metric(1, 1)),
            sse(3, "warning", {"message": "worker lost; requeued"}),
            sse(4, "metric", metric(2, 2)),
            sse(5, "status", {"status": "succeeded", "error": None}),
        ],
    )
    api.json("GET", f"/jobs/{JOB_ID}", job("succeeded", step=2, total_steps=2))
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with client_for(api) as client:
        final = follow_job(client, job("running"), live=True, console=console)
    assert final["status"] == "succeeded"
    assert "2/2" in out.getvalue() and "warning: worker lost; requeued" in out.getvalue()


# ---- downloads ----------------------------------------------------------------------------------

CHECKPOINTS = [
    {"step": 5, "kind": "deepspeed", "uri": "/runs/j/checkpoints/step-00000005", "bytes": 10},
    {"step": 10, "kind": "deepspeed", "uri": "/runs/j/checkpoints/step-00000010", "bytes": 10},
    {"step": 10, "kind": "model", "uri": "/runs/j/model", "bytes": 10},
]


def test_pick_checkpoint() -> None:
    assert pick_checkpoint(CHECKPOINTS, step=None, kind=None)["kind"] == "model"
    assert pick_checkpoint(CHECKPOINTS, step=None, kind="deepspeed")["step"] == 10
    assert pick_checkpoint(CHECKPOINTS, step=5, kind=None)["kind"] == "deepspeed"
    assert pick_checkpoint(CHECKPOINTS, step=10, kind=None)["kind"] == "model"
    with pytest.raises(ClientError, match="no adapter checkpoint"):
        pick_checkpoint(CHECKPOINTS, step=None, kind="adapter")
    with pytest.raises(ClientError, match=r"no checkpoint at step 7 \(the job has: deepspeed@5"):
        pick_checkpoint(CHECKPOINTS, step=7, kind=None)
    with pytest.raises(ClientError, match="no model or adapter checkpoint"):
        pick_checkpoint(CHECKPOINTS[:2], step=None, kind=None)


def test_copy_checkpoint(tmp_path: Path) -> None:
    source = tmp_path / "runs" / "j" / "model"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "weights.safetensors").write_bytes(b"x" * 100)
    checkpoint = {"step": 10, "kind": "model", "uri": f"file://{source}", "bytes": 102}
    out = copy_checkpoint(checkpoint, tmp_path / "here" / "exported")
    assert (out / "sub" / "weights.safetensors").read_bytes() == b"x" * 100
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["exported"]  # no staging left behind
    with pytest.raises(ClientError, match="already exists"):
        copy_checkpoint(checkpoint, out)
    (tmp_path / "empty").mkdir()
    assert (copy_checkpoint({**checkpoint, "uri": str(source)}, tmp_path / "empty") / "config.json").exists()


@pytest.mark.parametrize("uri", ["/nowhere/runs/j/model", "s3://bucket/runs/j/model"])
def test_a_checkpoint_this_host_cannot_read(tmp_path: Path, uri: str) -> None:
    with pytest.raises(ClientError, match="on the server; this client cannot read it: run on the server host"):
        copy_checkpoint({"step": 1, "kind": "model", "uri": uri, "bytes": 1}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- the commands -----------------------------------------------------------------------------


def invoke(api: FakeApi | None, *args: str) -> Any:
    url = api.url if api else f"http://127.0.0.1:{free_port()}"
    return CliRunner().invoke(app, list(args), env={"TUNEQ_URL": url, "TUNEQ_API_KEY": ""})


def test_submit_sends_the_body_and_prints_the_job(api: FakeApi, tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 1}))
    (tmp_path / "training.json").write_text(json.dumps({"max_steps": 3}))
    api.json("POST", "/jobs", job("queued"), status=201)
    args = ["submit", "--model", "org/name", "--dataset", "s3://b/train.jsonl", "--deepspeed", str(config)]
    result = invoke(api, *args, "--num-gpus", "2", "--name", "x", "--training", f"@{tmp_path / 'training.json'}")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"submitted job {JOB_ID} (queued)"
    body = json.loads(api.requests[0]["body"])
    assert body == {
        "model": "org/name",
        "dataset": "s3://b/train.jsonl",
        "deepspeed_config": {"train_batch_size": 1},
        "num_gpus": 2,
        "name": "x",
        "training": {"max_steps": 3},
    }
    as_json = invoke(api, *args, "--training", '{"max_steps": 3}', "--json", "--idempotency-key", "k-1")
    assert json.loads(as_json.stdout)["id"] == JOB_ID
    assert api.requests[1]["headers"]["Idempotency-Key"] == "k-1"


def test_submit_refused_prints_each_problem(api: FakeApi) -> None:
    detail = [{"type": "value_error", "loc": ["body", "training", "max_steps"], "msg": "must be > 0"}]
    api.json("POST", "/jobs", {"detail": detail}, status=422)
    result = invoke(api, "submit", "--model", "m/m", "--dataset", "/d.jsonl", "--deepspeed", "{}")
    assert result.exit_code == EXIT_API_ERROR
    assert "body.training.max_steps: must be > 0" in result.stderr


def test_submit_with_bad_json_is_a_usage_error(api: FakeApi) -> None:
    result = invoke(api, "submit", "--model", "m/m", "--dataset", "/d", "--deepspeed", "{}", "--training", "{oops")
    assert result.exit_code == 2 and "not valid JSON" in result.output
    assert api.requests == []


@pytest.mark.parametrize(
    ("status", "error", "code", "line"),
    [
        ("succeeded", None, 0, f"job {JOB_ID} succeeded at step 2/2"),
        (
            "failed",
            {"code": "training_error", "message": "CUDA OOM"},
            EXIT_FAILED,
            "failed at step 2/2: training_error: CUDA OOM",
        ),
        ("cancelled", None, EXIT_CANCELLED, f"job {JOB_ID} cancelled at step 2/2"),
    ],
)
def test_submit_follow_exits_with_the_outcome(
    api: FakeApi, status: str, error: dict[str, str] | None, code: int, line: str
) -> None:
    api.json("POST", "/jobs", job("queued"), status=201)
    api.sse(
        STREAM,
        [
            sse(1, "status", {"status": "running", "attempt": 1}),
            sse(2, "plan", {"total_steps": 2, "world_size": 1}),
            sse(3, "metric", metric(1, 1)),
            sse(4, "metric", metric(2, 3)),
            sse(5, "status", {"status": status, "error": error}),
        ],
    )
    api.json("GET", f"/jobs/{JOB_ID}", job(status, step=2, total_steps=2, error=error))
    result = invoke(api, "submit", "--model", "m/m", "--dataset", "/d", "--deepspeed", "{}", "--follow")
    assert result.exit_code == code, result.output
    assert "step 2/2 loss 2.5000 1500 tok/s eta 0s" in result.stdout
    assert line in (result.stdout if code == 0 else result.stderr)


def test_jobs_table_and_json(api: FakeApi) -> None:
    page = {"data": [job("running", step=3, total_steps=10, latest_metrics={"loss": 1.25})], "count": 7}
    api.json("GET", "/jobs", page)
    table = invoke(api, "jobs", "--status", "running", "--limit", "1")
    assert table.exit_code == 0, table.output
    row = next(line for line in table.stdout.splitlines() if JOB_ID in line)
    assert row.split() == [JOB_ID, "sft", "running", "3/10", "1.2500", "2026-12-02", "10:00:00", "tiny-gpt-neo"]
    assert "1 of 7 jobs" in table.stdout
    assert api.requests[0]["query"] == "skip=0&limit=1&status=running"
    assert json.loads(invoke(api, "jobs", "--json").stdout) == page
    assert invoke(api, "jobs", "--status", "runnin").exit_code == 2


def test_show_cancel_logs(api: FakeApi) -> None:
    error = {"code": "timeout", "message": "ran past 60 s"}
    api.json("GET", f"/jobs/{JOB_ID}", job("failed", step=4, total_steps=4, error=error))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": CHECKPOINTS})
    api.json("POST", f"/jobs/{JOB_ID}/cancel", {"detail": f"job {JOB_ID} already failed"}, status=409)
    api.json("GET", f"/jobs/{JOB_ID}/logs", {"lines": ["one", "two"]})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    assert "timeout: ran past 60 s" in shown.stdout and "step 4/4" in shown.stdout
    assert "model step 10" in shown.stdout
    assert json.loads(invoke(api, "show", JOB_ID, "--json").stdout)["status"] == "failed"
    cancelled = invoke(api, "cancel", JOB_ID)
    assert cancelled.exit_code == EXIT_API_ERROR and f"conflict (409): job {JOB_ID} already failed" in cancelled.stderr
    logs = invoke(api, "logs", JOB_ID, "--tail", "2")
    assert logs.stdout.splitlines() == ["one", "two"]
    assert api.requests[-1]["query"] == "tail=2"


def test_logs_follow_streams_lines(api: FakeApi) -> None:
    def serve(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; charset=utf-8")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        h.chunk(b"first\nsec")
        h.chunk(b"ond\n")
        h.wfile.write(b"0\r\n\r\n")

    api.route("GET", f"/jobs/{JOB_ID}/logs", serve)
    result = invoke(api, "logs", JOB_ID, "--follow", "--tail", "5")
    assert result.exit_code == 0 and result.stdout.splitlines() == ["first", "second"]
    assert api.requests[0]["query"] == "tail=5&follow=true"


def test_download_where_the_runs_are_readable(api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "runs" / "j" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": [{**CHECKPOINTS[2], "uri": str(model)}, CHECKPOINTS[0]]})
    monkeypatch.chdir(tmp_path)
    done = invoke(api, "download", JOB_ID)
    assert done.exit_code == 0, done.output
    assert (tmp_path / f"tuneq-{JOB_ID[:8]}-model-10" / "config.json").exists()
    remote = invoke(api, "download", JOB_ID, "--kind", "deepspeed", "--checkpoint", "5")
    assert remote.exit_code == EXIT_FAILED
    assert "checkpoint is at /runs/j/checkpoints/step-00000005 on the server" in remote.stderr
    assert invoke(api, "download", JOB_ID, "--kind", "weights").exit_code == 2


def test_unreachable_and_unknown(api: FakeApi) -> None:
    nobody = invoke(None, "jobs")
    assert nobody.exit_code == EXIT_UNREACHABLE and "is `tuneq serve` running at" in nobody.stderr
    missing = invoke(api, "show", str(uuid.uuid4()))
    assert missing.exit_code == EXIT_API_ERROR and "not found (404)" in missing.stderr
