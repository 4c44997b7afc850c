"""The API while it stops: 503 with Retry-After, never a dropped connection (api/server_stop.py).

The whole stop, with `tuneq serve` and a plan in flight, is tests/e2e/test_faults.py's; here the
two answers the middleware gives, in process.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import uvicorn
from fastapi.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from api.errors import UNAVAILABLE_RETRY_AFTER_SECONDS
from api.server_stop import ServerStop, StoppingServer, UnavailableWhileStopping


def test_once_the_stop_began_a_request_is_a_503_with_retry_after_in_its_api_s_shape(tuneq_home: Path) -> None:
    from api.main import create_app

    app = create_app()
    stop: ServerStop = app.state.server_stop
    StoppingServer(uvicorn.Config(app), stop=stop).handle_exit(signal.SIGTERM, None)  # as the signal does
    assert stop.began
    client = TestClient(app)
    native = client.get("/jobs")
    assert native.status_code == 503 and native.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "stopping" in native.json()["detail"]
    openai = client.get("/v1/models")
    assert openai.status_code == 503 and openai.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert openai.json()["error"]["type"] == "server_error" and "stopping" in openai.json()["error"]["message"]


def _cut_off(*, started: bool) -> tuple[list[Message], BaseException | None, ServerStop]:
    """A request whose route is still running (its answer started or not) when uvicorn cancels it,
    as at the end of the stop's grace: what was sent, what the request's task ended with."""
    stop = ServerStop()
    sent: list[Message] = []

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if started:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.Event().wait()  # a plan that is still tokenizing

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    async def request() -> BaseException | None:
        scope: Scope = {"type": "http", "method": "POST", "path": "/jobs/plan", "headers": []}
        task = asyncio.create_task(UnavailableWhileStopping(route, stop=stop)(scope, receive, send))
        await asyncio.sleep(0)  # the request's task runs up to the route's wait
        assert stop.in_flight == 1
        task.cancel()
        await stop.requests_ended(timeout=5)  # as the lifespan's shutdown does
        [ended] = await asyncio.gather(task, return_exceptions=True)
        return ended

    return sent, asyncio.run(request()), stop


def test_a_request_the_stop_s_grace_cuts_off_before_its_answer_is_a_503() -> None:
    sent, ended, stop = _cut_off(started=False)
    assert ended is None and stop.in_flight == 0
    assert sent[0]["status"] == 503
    assert (b"retry-after", str(UNAVAILABLE_RETRY_AFTER_SECONDS).encode()) in sent[0]["headers"]
    assert b"stopping" in sent[1]["body"]


def test_a_stream_the_stop_s_grace_cuts_off_ends_where_it_is() -> None:
    sent, ended, stop = _cut_off(started=True)
    assert isinstance(ended, asyncio.CancelledError) and stop.in_flight == 0
    assert [m["type"] for m in sent] == ["http.response.start"]
