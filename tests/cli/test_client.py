"""The command-line client without a tuneq service: a real local HTTP server in a thread
serves canned answers and canned Server-Sent Events (including a dropped connection)."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource
from sqlmodel import Session
from typer.testing import CliRunner

from cli.client import (
    DOWNLOAD_STATE_NAME,
    EXIT_API_ERROR,
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    ApiError,
    ClientError,
    ClientSettings,
    FollowState,
    JobEvent,
    RemoteFile,
    ServerUnreachable,
    TuneqClient,
    checkpoint_files,
    describe_error,
    download_with_progress,
    exit_code_for,
    follow_job,
    format_duration,
    pick_checkpoint,
    plan_download,
)
from cli.main import app
from shared.artifacts.store import ArtifactStore, job_key
from shared.db.artifacts import commit_checkpoint
from shared.db.engine import get_engine, init_db
from shared.db.models import CheckpointKind, Job, utcnow
from shared.jobs.run_layout import CheckpointManifest
from shared.jobs.status import JobStatus
from shared.ports import free_port
from shared.settings import get_settings
from tests.conftest import clear_caches

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
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.requests: list[dict[str, Any]] = []
        handler = type("BoundHandler", (Handler,), {"api": self})
        self.server = ThreadingHTTPServer((host, 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
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
        "num_nodes": 1,
        "nodes": [],
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
        state.apply(_event(2, "plan", {"total_steps": 4, "world_size": 2, "kernels": ["rope"], "compiled": True})),
        state.apply(_event(3, "metric", metric(1, 10, loss=3.0))),
        state.apply(_event(4, "metric", metric(2, 12, loss=2.0))),
        state.apply(_event(5, "log", {"line": "rank 0 says hi"})),
        state.apply(_event(6, "checkpoint", {"kind": "model", "step": 2, "uri": "/runs/x/model"})),
        state.apply(_event(7, "status", {"status": "succeeded", "error": None})),
    ]
    assert lines == [
        "running (attempt 1)",
        "plan: 4 steps on 2 rank(s)",
        "plan: 4 steps on 2 rank(s); kernels: rope; compiled",
        "step 1/4 loss 3.0000 1500 tok/s eta ?",
        "step 2/4 loss 2.0000 1500 tok/s eta 4s",  # 2 s per step, 2 steps to go
        None,
        "checkpoint model at step 2: /runs/x/model",
        None,
    ]
    assert state.outcome_line() == f"job {JOB_ID} succeeded at step 2/4 (loss 2.0000)"


def test_a_dpo_jobs_follow_shows_the_reference_pass_and_the_rewards() -> None:
    state = FollowState.from_job(job("running", total_steps=4))
    phase = {"name": "reference_logps", "done": 120, "total": 400, "cached": False, "time": "2026-12-02T10:00:00Z"}
    dpo = {**metric(1, 10, loss=0.69), "rewards_accuracies": 0.75, "rewards_margins": 0.3125, "rewards_chosen": 0.1}
    lines = [
        state.apply(_event(1, "phase", phase)),
        state.apply(_event(2, "phase", {**phase, "done": 400, "cached": True})),
        state.apply(_event(3, "metric", dpo)),
        state.apply(_event(4, "metric", metric(2, 12, loss=0.6))),  # a step without them keeps the last
    ]
    assert lines == [
        "reference log-probabilities: 120/400 pairs",
        "reference log-probabilities: found cached (400 pairs)",
        "step 1/4 loss 0.6900 1500 tok/s eta ? rewards/accuracies 0.7500 rewards/margins 0.3125",
        "step 2/4 loss 0.6000 1500 tok/s eta 4s rewards/accuracies 0.7500 rewards/margins 0.3125",
    ]
    # An SFT job's line is as it was.
    assert FollowState.from_job(job("running", latest_metrics=metric(1, 10))).progress_text.endswith("eta ?")


def test_show_a_dpo_job(api: FakeApi) -> None:
    latest = {**metric(3, 10, loss=0.5), "rewards_chosen": 0.4, "rewards_rejected": -0.2}
    latest.update(rewards_margins=0.6, rewards_accuracies=0.875, eval_rewards_accuracies=None)
    phase = {"name": "reference_logps", "done": 400, "total": 400, "cached": False, "time": "2026-12-02T10:00:00Z"}
    api.json("GET", f"/jobs/{JOB_ID}", job("running", step=3, latest_metrics=latest, phase=phase))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    lines = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert "phase reference log-probabilities: 400/400 pairs" in lines
    assert [line for line in lines if line.startswith("rewards/")] == [
        "rewards/chosen 0.4000",
        "rewards/rejected -0.2000",
        "rewards/margins 0.6000",
        "rewards/accuracies 0.8750",
    ]
    assert not any(line.startswith("eval_rewards") for line in lines)  # not measured at this step
    api.json("GET", f"/jobs/{JOB_ID}", job("running", step=3, latest_metrics=metric(3, 10)))
    sft = [" ".join(line.split()) for line in invoke(api, "show", JOB_ID).stdout.splitlines()]
    assert not any(line.startswith(("rewards/", "phase")) for line in sft)


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


def test_a_follow_ends_with_the_streams_outcome_though_the_api_answers_an_older_read(api: FakeApi) -> None:
    """The stream says cancelled; GET /jobs/{id} may come from the API's read of the job up to
    TUNEQ_JOB_CACHE_SECONDS old (still cancelling): the follow reads it again, and ends
    cancelled (exit 3), not with a non-terminal status (exit 1)."""
    api.sse(STREAM, [sse(1, "status", {"status": "cancelling"}), sse(2, "status", {"status": "cancelled"})])
    answers = [job("cancelling", step=7), job("cancelled", step=7, error={"code": "cancelled", "message": "x"})]

    def get_job(h: Handler) -> None:
        send_json(h, 200, answers.pop(0) if len(answers) > 1 else answers[0])

    api.route("GET", f"/jobs/{JOB_ID}", get_job)
    from rich.console import Console

    with client_for(api) as client:
        final = follow_job(client, job("running"), live=False, console=Console(file=io.StringIO()))
    assert final["status"] == "cancelled" and exit_code_for(final["status"]) == EXIT_CANCELLED
    assert len([r for r in api.requests if r["path"] == f"/jobs/{JOB_ID}"]) == 2


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


def test_checkpoint_files_are_named_inside_the_checkpoint_directory() -> None:
    def artifact(path: str, kind: str = "deepspeed", step: int | None = 4) -> dict[str, Any]:
        return {"path": path, "kind": kind, "step": step, "size": 1, "sha256": "0" * 64}

    artifacts = [
        artifact("checkpoints/step-00000004/global_step4/mp_rank_00_model_states.pt"),
        artifact("checkpoints/step-00000004/latest"),
        artifact("checkpoints/step-00000004/tuneq-manifest.json"),
        artifact("checkpoints/step-00000008/tuneq-manifest.json", step=8),
        artifact("model/tuneq-manifest.json", kind="model"),
        artifact("train.log", kind="log", step=None),
    ]
    checkpoint = {"kind": "deepspeed", "step": 4, "uri": "/runs/j/checkpoints/step-00000004"}
    assert [f.name for f in checkpoint_files(artifacts, checkpoint)] == [
        "global_step4/mp_rank_00_model_states.pt",
        "latest",
        "tuneq-manifest.json",
    ]
    with pytest.raises(ClientError, match="lists no files of the adapter checkpoint at step 4"):
        checkpoint_files(artifacts, {**checkpoint, "kind": "adapter"})
    sneaky = [artifact("checkpoints/step-00000004/../../../etc/passwd"), artifacts[2]]
    with pytest.raises(ClientError, match="not a file name to write here"):
        checkpoint_files(sneaky, checkpoint)


# ---- downloads from a real API (uvicorn in a thread, SQLite, the local artifact store) ----------


@dataclass
class Recorder:
    """The API app, recording each request: its path, headers, status and the body bytes sent."""

    app: Any
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        entry: dict[str, Any] = {"path": scope["path"], "headers": headers, "status": None, "sent": 0}
        self.requests.append(entry)

        async def counting(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            elif message["type"] == "http.response.body":
                entry["sent"] += len(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, counting)

    def downloads(self, name: str) -> list[dict[str, Any]]:
        """The GETs of artifact files whose path ends with ``name``."""
        return [r for r in self.requests if "/artifacts/" in r["path"] and r["path"].endswith(f"/{name}")]


@dataclass
class ServedApi:
    url: str
    recorder: Recorder
    job_id: str
    sources: Path

    def publish(self, kind: str, step: int, directory: str, files: dict[str, bytes]) -> dict[str, bytes]:
        """Publish a checkpoint as the worker does (its files, the manifest last, then one
        commit); returns what its directory holds, manifest included."""
        source = self.sources / directory
        for name, data in files.items():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes(data)
        manifest = CheckpointManifest.describe(
            source, step=step, tag=f"step-{step:08d}", kind=kind, world_size=1, created_at=utcnow().isoformat()
        )
        manifest.write(source)
        store = ArtifactStore.from_settings(get_settings())
        names = [*sorted(files), CheckpointManifest.FILENAME]
        stored = [
            (f"{directory}/{n}", store.put_file(source / n, job_key(self.job_id, f"{directory}/{n}"))) for n in names
        ]
        with Session(get_engine()) as session:
            commit_checkpoint(
                session,
                job_id=uuid.UUID(self.job_id),
                kind=CheckpointKind(kind),
                step=step,
                uri=store.uri_of(job_key(self.job_id, directory)),
                files=stored,
                created_at=utcnow(),
            )
            session.commit()
        return {**files, CheckpointManifest.FILENAME: (source / CheckpointManifest.FILENAME).read_bytes()}

    def stored(self, path: str) -> Path:
        """The store's copy of a file of the job (the default store: TUNEQ_HOME/runs)."""
        return get_settings().runs_dir / self.job_id / path


@pytest.fixture
def served(tuneq_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServedApi]:
    import uvicorn

    from api.main import create_app

    monkeypatch.setenv("TUNEQ_DATABASE_URL", f"sqlite:///{tuneq_home / 'tuneq.sqlite'}")
    clear_caches()
    init_db()  # what the app's lifespan does (left off: it also warms DeepSpeed's config parser)
    with Session(get_engine()) as session:
        job = Job(model="m", dataset="d", deepspeed_config={}, num_gpus=1, training={}, status=JobStatus.succeeded)
        session.add(job)
        session.commit()
        job_id = str(job.id)
    recorder = Recorder(create_app())
    port = free_port()
    config = uvicorn.Config(recorder, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API did not start"
        time.sleep(0.02)
    yield ServedApi(url=f"http://127.0.0.1:{port}", recorder=recorder, job_id=job_id, sources=tmp_path / "sources")
    server.should_exit = True
    thread.join(10)


# Bigger than a chunk of the server (1 MiB) and of the client, so files come in several.
WEIGHTS = bytes(range(256)) * (3 * 4096 + 17)
MODEL_FILES = {"config.json": b'{"model_type": "gpt_neo"}\n', "model.safetensors": WEIGHTS}


def tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_download_a_model_checkpoint(served: ServedApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served.publish("deepspeed", 8, "checkpoints/step-00000008", {"latest": b"global_step8"})
    expected = served.publish("model", 8, "model", MODEL_FILES)
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    done = invoke(served.url, "download", served.job_id)
    assert done.exit_code == 0, done.output
    dest = workdir / f"tuneq-{served.job_id[:8]}-model-8"
    assert tree(dest) == expected
    assert [p.name for p in workdir.iterdir()] == [dest.name]  # no staging left
    total = sum(len(data) for data in expected.values())
    assert done.stdout == f"downloaded the model checkpoint at step 8 to {dest.name} (3 files, {total / 1e6:.1f} MB)\n"
    assert done.stderr == ""  # not a terminal: no progress bar
    (weights,) = served.recorder.downloads("model.safetensors")
    assert weights["status"] == 200 and weights["sent"] == len(WEIGHTS) and "range" not in weights["headers"]

    again = invoke(served.url, "download", served.job_id, "--model")
    assert again.exit_code == EXIT_FAILED and "already exists and is not an empty directory" in again.stderr
    assert len(served.recorder.downloads("model.safetensors")) == 1


def test_a_download_cut_short_resumes(served: ServedApi, tmp_path: Path) -> None:
    expected = served.publish("model", 8, "model", MODEL_FILES)
    dest = tmp_path / "exported"
    staging = tmp_path / ".exported.partial"  # what an interrupted `tuneq download ID exported` left
    staging.mkdir()
    half = len(WEIGHTS) // 2
    (staging / "model.safetensors").write_bytes(WEIGHTS[:half])
    (staging / "config.json").write_bytes(b"X" * len(MODEL_FILES["config.json"]))  # complete, but not the file
    (staging / CheckpointManifest.FILENAME).write_bytes(expected[CheckpointManifest.FILENAME])  # complete and right
    (staging / "stale.bin").write_bytes(b"from an earlier listing")

    done = invoke(served.url, "download", served.job_id, str(dest), "--json")
    assert done.exit_code == 0, done.output
    answer = json.loads(done.stdout)
    total = sum(len(data) for data in expected.values())
    manifest_size = len(expected[CheckpointManifest.FILENAME])
    assert answer["kind"] == "model" and answer["step"] == 8 and answer["output"] == str(dest)
    assert (answer["files"], answer["bytes"], answer["resumed_bytes"]) == (3, total, half + manifest_size)
    assert tree(dest) == expected and not staging.exists()
    (weights,) = served.recorder.downloads("model.safetensors")
    assert weights["headers"]["range"] == f"bytes={half}-"
    assert weights["headers"]["if-range"] == f'"{hashlib.sha256(WEIGHTS).hexdigest()}"'
    assert weights["status"] == 206 and weights["sent"] == len(WEIGHTS) - half  # only the second half
    (config,) = served.recorder.downloads("config.json")
    assert config["status"] == 200 and "range" not in config["headers"]  # fetched again, whole
    assert served.recorder.downloads(CheckpointManifest.FILENAME) == []  # not fetched again


def test_a_partial_copy_of_another_version_is_fetched_whole(served: ServedApi, tmp_path: Path) -> None:
    served.publish("model", 8, "model", MODEL_FILES)
    staging = tmp_path / ".exported.partial"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"an older export's bytes")
    (staging / DOWNLOAD_STATE_NAME).write_text(json.dumps({"model/model.safetensors": "f" * 64}))
    done = invoke(served.url, "download", served.job_id, "--output", str(tmp_path / "exported"), "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["resumed_bytes"] == 0
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == WEIGHTS
    assert not (tmp_path / "exported" / DOWNLOAD_STATE_NAME).exists()
    (weights,) = served.recorder.downloads("model.safetensors")
    assert weights["headers"]["if-range"] == f'"{"f" * 64}"' and weights["status"] == 200


def test_a_checksum_mismatch_fails_and_leaves_no_destination(served: ServedApi, tmp_path: Path) -> None:
    served.publish("model", 8, "model", MODEL_FILES)
    served.stored("model/model.safetensors").write_bytes(WEIGHTS[::-1])  # changed in the store, same size
    dest = tmp_path / "exported"
    failed = invoke(served.url, "download", served.job_id, str(dest))
    assert failed.exit_code == EXIT_FAILED, failed.output
    assert "tuneq: model/model.safetensors is not the file the server lists" in failed.stderr
    assert not dest.exists()
    assert not (tmp_path / ".exported.partial" / "model.safetensors").exists()  # deleted, to be fetched anew


def test_download_a_deepspeed_checkpoint_by_step(served: ServedApi, tmp_path: Path) -> None:
    step4 = {"latest": b"global_step4", "global_step4/mp_rank_00_model_states.pt": b"state 4" * 1000}
    expected = served.publish("deepspeed", 4, "checkpoints/step-00000004", step4)
    served.publish("deepspeed", 8, "checkpoints/step-00000008", {"latest": b"global_step8"})
    served.publish("model", 8, "model", MODEL_FILES)
    by_step = invoke(served.url, "download", served.job_id, "--step", "4", "--output", str(tmp_path / "ds4"))
    assert by_step.exit_code == 0, by_step.output
    assert "downloaded the deepspeed checkpoint at step 4" in by_step.stdout
    assert tree(tmp_path / "ds4") == expected
    alias = invoke(
        served.url, "download", served.job_id, str(tmp_path / "ds8"), "--checkpoint", "8", "--kind", "deepspeed"
    )
    assert alias.exit_code == 0, alias.output
    assert (tmp_path / "ds8" / "latest").read_bytes() == b"global_step8"
    missing = invoke(served.url, "download", served.job_id, "--step", "5", "--output", str(tmp_path / "ds5"))
    assert missing.exit_code == EXIT_FAILED and "no checkpoint at step 5" in missing.stderr


def test_the_progress_bar_on_a_terminal(served: ServedApi, tmp_path: Path) -> None:
    from rich.console import Console

    expected = served.publish("model", 8, "model", MODEL_FILES)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with TuneqClient(ClientSettings(url=served.url)) as client:
        checkpoint = pick_checkpoint(client.checkpoints(served.job_id), step=None, kind=None)
        plan = plan_download(client, served.job_id, checkpoint, tmp_path / "exported")
        result = download_with_progress(client, plan, console=console)
    total = sum(len(data) for data in expected.values())
    assert (result.files, result.bytes, result.received_bytes, result.resumed_bytes) == (3, total, total, 0)
    assert f"{total / 1e6:.1f}/{total / 1e6:.1f} MB" in out.getvalue()


def test_a_redirect_sends_no_api_key_to_the_other_host(tmp_path: Path) -> None:
    """A 307 to a presigned URL elsewhere: followed, with the Range but without the API key."""
    data = b"0123456789" * 100
    api, store = FakeApi(), FakeApi(host="127.0.0.2")  # another origin (all of 127/8 is loopback)

    def presigned(h: Handler) -> None:
        first = int(h.headers["Range"].removeprefix("bytes=").rstrip("-"))
        h.send_response(206)
        h.send_header("Content-Length", str(len(data) - first))
        h.send_header("Content-Range", f"bytes {first}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        h.wfile.write(data[first:])

    def redirect(h: Handler) -> None:
        h.send_response(307)
        h.send_header("Location", f"{store.url}/bucket/key?X-Amz-Signature=abc")
        h.send_header("Content-Length", "0")
        h.end_headers()

    api.route("GET", f"/jobs/{JOB_ID}/artifacts/model/model.safetensors", redirect)
    store.route("GET", "/bucket/key", presigned)
    for fake in (api, store):
        fake.thread.start()
    try:
        target = tmp_path / "model.safetensors"
        target.write_bytes(data[:300])
        file = RemoteFile("model/model.safetensors", "model.safetensors", len(data), hashlib.sha256(data).hexdigest())
        with client_for(api, api_key="secret-key") as client:
            fetched = client.fetch_artifact(JOB_ID, file, target)
    finally:
        for fake in (api, store):
            fake.server.shutdown()
            fake.server.server_close()
    assert target.read_bytes() == data and (fetched.received, fetched.resumed) == (700, 300)
    (asked,) = api.requests
    (signed,) = store.requests
    assert asked["headers"]["Authorization"] == "Bearer secret-key"
    assert "Authorization" not in signed["headers"] and signed["headers"]["Range"] == "bytes=300-"


def test_a_dropped_download_keeps_what_arrived(api: FakeApi, tmp_path: Path) -> None:
    data = b"x" * 5000

    def cut_off(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data[:2000])
        h.wfile.flush()
        h.close_connection = True

    api.route("GET", f"/jobs/{JOB_ID}/artifacts/model/model.safetensors", cut_off)
    target = tmp_path / "model.safetensors"
    file = RemoteFile("model/model.safetensors", "model.safetensors", len(data), hashlib.sha256(data).hexdigest())
    with client_for(api) as client, pytest.raises(ServerUnreachable):
        client.fetch_artifact(JOB_ID, file, target)
    assert target.read_bytes() == data[:2000]  # for the next try to continue


# ---- the commands -----------------------------------------------------------------------------


def invoke(api: FakeApi | str | None, *args: str) -> Any:
    """The ``tuneq`` command against a FakeApi, an URL, or nothing listening."""
    url = api.url if isinstance(api, FakeApi) else api or f"http://127.0.0.1:{free_port()}"
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


def test_submit_without_deepspeed_sends_no_config_for_tuneq_to_choose(api: FakeApi) -> None:
    api.json("POST", "/jobs", job("queued"), status=201)
    result = invoke(api, "submit", "--model", "m/m", "--dataset", "/d.jsonl")
    assert result.exit_code == 0, result.output
    assert json.loads(api.requests[0]["body"]) == {"model": "m/m", "dataset": "/d.jsonl", "num_gpus": 1}


def test_submit_num_nodes(api: FakeApi) -> None:
    api.json("POST", "/jobs", job("queued", num_gpus=4, num_nodes=2), status=201)
    args = ["submit", "--model", "m/m", "--dataset", "/d.jsonl", "--deepspeed", "{}", "--num-gpus", "4"]
    result = invoke(api, *args, "--num-nodes", "2")
    assert result.exit_code == 0, result.output
    body = json.loads(api.requests[0]["body"])
    assert (body["num_gpus"], body["num_nodes"]) == (4, 2)
    # One node (the default) sends no num_nodes: the body a server without multi-node jobs takes.
    assert invoke(api, *args, "--num-nodes", "1").exit_code == 0
    assert "num_nodes" not in json.loads(api.requests[1]["body"])
    refused = invoke(api, *args, "--num-nodes", "0")
    assert refused.exit_code == 2 and len(api.requests) == 2
    wide = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "250"})  # no wrapped help lines
    (option,) = [line for line in wide.stdout.splitlines() if "--num-nodes" in line]
    assert "[x>=1]" in option and "the world size is nodes x GPUs per node" in option


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
    assert row.split() == [JOB_ID, "sft", "running", "1", "3/10", "1.2500", "2026-12-02", "10:00:00", "tiny-gpt-neo"]
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


def test_pause_and_resume(api: FakeApi) -> None:
    api.json("POST", f"/jobs/{JOB_ID}/pause", job("pausing", step=3))
    detail = f"job {JOB_ID} is pausing; only a paused job can be resumed; wait until it is paused"
    api.json("POST", f"/jobs/{JOB_ID}/resume", {"detail": detail}, status=409)
    api.json("GET", f"/jobs/{JOB_ID}", job("paused", step=3, attempts=2, pauses=1))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    paused = invoke(api, "pause", JOB_ID)
    assert paused.exit_code == 0 and paused.stdout.strip() == f"job {JOB_ID}: pausing", paused.output
    assert json.loads(invoke(api, "pause", JOB_ID, "--json").stdout)["status"] == "pausing"
    early = invoke(api, "resume", JOB_ID)
    assert early.exit_code == EXIT_API_ERROR and f"conflict (409): {detail}" in early.stderr
    assert [(r["method"], r["path"]) for r in api.requests[-3:]] == [
        ("POST", f"/jobs/{JOB_ID}/pause"),
        ("POST", f"/jobs/{JOB_ID}/pause"),
        ("POST", f"/jobs/{JOB_ID}/resume"),
    ]
    shown = invoke(api, "show", JOB_ID)
    assert "paused" in shown.stdout and "2, 1 paused (max restarts 2)" in shown.stdout, shown.output
    # Following a job that pauses says how to go on; the follow waits for the resume.
    state = FollowState.from_job(job("running"))
    line = state.apply(_event(9, "status", {"status": "paused", "step": 7, "attempt": 1}))
    assert line == f"paused at step 7 (`tuneq resume {JOB_ID}` continues it)" and state.step == 7


def test_show_and_jobs_a_multi_node_job(api: FakeApi) -> None:
    nodes = [
        {
            "node_rank": 0,
            "worker_id": "gpu-a",
            "address": "10.0.0.5",
            "ranks": [0, 3],
            "state": "released",
            "error_message": None,
        },
        {
            "node_rank": 1,
            "worker_id": "gpu-b",
            "address": "10.0.0.6",
            "ranks": [4, 7],
            "state": "released",
            "error_message": "[rank5]: exited with code 1",
        },
    ]
    gang = job("failed", num_gpus=4, num_nodes=2, nodes=nodes)
    api.json("GET", f"/jobs/{JOB_ID}", gang)
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    api.json("GET", "/jobs", {"data": [gang, {**job("queued"), "id": str(uuid.uuid4())}], "count": 2})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    lines = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert "num_gpus 4" in lines and "num_nodes 2" in lines
    assert [line for line in lines if line.startswith("node ")] == [
        "node 0 worker gpu-a at 10.0.0.5, ranks 0-3, released",
        "node 1 worker gpu-b at 10.0.0.6, ranks 4-7, released: [rank5]: exited with code 1",
    ]
    listed = invoke(api, "jobs")
    assert listed.exit_code == 0, listed.output
    gpus = [line.split()[3] for line in listed.stdout.splitlines() if "sft" in line]
    assert gpus == ["2x4", "1"]  # nodes x GPUs per node; a one-node job its GPUs


def test_show_a_one_node_job_has_no_node_lines(api: FakeApi) -> None:
    api.json("GET", f"/jobs/{JOB_ID}", job("running"))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    lines = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert "num_nodes 1" in lines and not any(line.startswith("node ") for line in lines)


def test_show_and_jobs_print_the_jobs_text_not_markup(api: FakeApi) -> None:
    error = {"code": "training_error", "message": "[rank3]: CUDA OOM [/x]"}
    shown_job = job("failed", name="[bold]sft[/bold]", model="/srv/models/[v2]", error=error)
    api.json("GET", f"/jobs/{JOB_ID}", shown_job)
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    api.json("GET", "/jobs", {"data": [shown_job], "count": 1})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    assert "training_error: [rank3]: CUDA OOM [/x]" in shown.stdout
    assert "[bold]sft[/bold]" in shown.stdout
    listed = invoke(api, "jobs")
    assert listed.exit_code == 0, listed.output
    assert "[bold]sft[/bold]" in listed.stdout and "[v2]" in listed.stdout


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


def test_download_usage_errors(api: FakeApi, tmp_path: Path) -> None:
    both = invoke(api, "download", JOB_ID, str(tmp_path / "a"), "--output", str(tmp_path / "b"))
    assert both.exit_code == 2 and "Invalid value for DEST, --output: both name the" in both.output
    assert invoke(api, "download", JOB_ID, "--kind", "weights").exit_code == 2
    assert invoke(api, "download", JOB_ID, "--model", "--kind", "adapter").exit_code == 2
    assert api.requests == [] and list(tmp_path.iterdir()) == []


def test_unreachable_and_unknown(api: FakeApi) -> None:
    nobody = invoke(None, "jobs")
    assert nobody.exit_code == EXIT_UNREACHABLE and "is `tuneq serve` running at" in nobody.stderr
    missing = invoke(api, "show", str(uuid.uuid4()))
    assert missing.exit_code == EXIT_API_ERROR and "not found (404)" in missing.stderr
