"""A real local HTTP server in a thread that serves canned answers and canned Server-Sent
Events (including a dropped connection), for the client without a tuneq service; and the
``tuneq`` command run against it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from typer.testing import CliRunner

from cli.api_client import ClientSettings, TuneqClient
from cli.main import app
from shared.ports import free_port

JOB_ID = "6f1c2a8e-1b2c-4d5e-8f90-123456789abc"
STREAM = f"/jobs/{JOB_ID}/events/stream"

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


def client_for(api: FakeApi, *, api_key: str | None = None, reconnect_for: float = 5.0) -> TuneqClient:
    return TuneqClient(ClientSettings(url=api.url, api_key=api_key), reconnect_for=reconnect_for)


def invoke(api: FakeApi | str | None, *args: str) -> Any:
    """The ``tuneq`` command against a FakeApi, an URL, or nothing listening."""
    url = api.url if isinstance(api, FakeApi) else api or f"http://127.0.0.1:{free_port()}"
    return CliRunner().invoke(app, list(args), env={"TUNEQ_URL": url, "TUNEQ_API_KEY": ""})


def sse(event_id: int, type: str, data: dict[str, Any]) -> bytes:
    body = {"id": event_id, "type": type, "data": data, "created_at": "2026-12-02T10:00:00Z"}
    return f"id: {event_id}\r\nevent: {type}\r\ndata: {json.dumps(body)}\r\n\r\n".encode()


def job(status: str = "running", **fields: Any) -> dict[str, Any]:
    """A job as GET /jobs/{id} answers it."""
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


# GET /jobs/{id}/checkpoints' rows.
CHECKPOINTS = [
    {"step": 5, "kind": "deepspeed", "uri": "/runs/j/checkpoints/step-00000005", "bytes": 10},
    {"step": 10, "kind": "deepspeed", "uri": "/runs/j/checkpoints/step-00000010", "bytes": 10},
    {"step": 10, "kind": "model", "uri": "/runs/j/model", "bytes": 10},
]
