"""What requests get while the API stops (SIGTERM: ``docker stop``, systemd, ``tuneq dev``).

uvicorn stops accepting connections at once and gives the requests in flight
``TUNEQ_API_STOP_GRACE_SECONDS`` to finish; then it cancels those still running (a plan still
tokenizing its dataset), runs the lifespan's shutdown and ends the process. A cancelled request
used to end with its connection closed and no answer: a protocol error for the client, after the
grace. Here it is answered 503 with ``Retry-After``, as a database outage is
(``api.errors.unavailable_response``), so clients retry it against another replica or the
restarted server. A request that arrives after the stop began, on a connection opened before it,
gets the same 503 at once instead of starting work the stop may cut off.

uvicorn tells the app that it stops only after the grace (the lifespan's shutdown), so ``tuneq
serve`` runs :class:`StoppingServer`, which says so when the signal comes. And uvicorn never
awaits the requests it cancelled: a cancelled request reaches its answer only once what it was in
has unwound (FastAPI closing its session, in a thread), by which time uvicorn would have finished
the lifespan's shutdown and re-raised the signal. So the lifespan's shutdown first waits for the
requests in flight to end (:meth:`ServerStop.requests_ended`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import unavailable_response

logger = logging.getLogger(__name__)

STOPPING = "the server is stopping: retry after the Retry-After seconds"


class ServerStop:
    """Whether the server has begun to stop, and how many requests are in flight
    (``app.state.server_stop``)."""

    def __init__(self) -> None:
        self.began = False
        self.in_flight = 0

    def begin(self) -> None:
        # Called from a signal handler: a plain assignment, no lock to deadlock on.
        self.began = True

    async def requests_ended(self, *, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the requests in flight to end. Polled rather than
        an ``asyncio.Event``, which would bind to one event loop (tests run one app in several)."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.in_flight:
            logger.warning("%d requests had not ended when the server stopped", self.in_flight)


class UnavailableWhileStopping:
    """ASGI middleware: a 503 with ``Retry-After`` for a request that arrives once the stop began,
    and for one the stop's grace cut off before its answer started (module docstring). A stream
    that had started answering ends where it is, as it would on any disconnect."""

    def __init__(self, app: ASGIApp, *, stop: ServerStop) -> None:
        self.app = app
        self.stop = stop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.stop.began:
            await unavailable_response(scope["path"], STOPPING)(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.stop.in_flight += 1
        try:
            await self.app(scope, receive, send_tracked)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when the stop's grace ends. The route's
            # thread (a plan waiting for its child) runs on until the lifespan stops the child.
            if started:
                raise
            if (task := asyncio.current_task()) is not None:
                task.uncancel()  # handled: the request ends with this answer
            logger.warning(
                "%s %s: still running when the stop's grace ended: answered 503", scope["method"], scope["path"]
            )
            await unavailable_response(scope["path"], STOPPING)(scope, receive, send)
        finally:
            self.stop.in_flight -= 1


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which tells the app's :class:`ServerStop` as soon as a stop signal comes."""

    def __init__(self, config: uvicorn.Config, *, stop: ServerStop) -> None:
        super().__init__(config)
        self.server_stop = stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.server_stop.begin()
        super().handle_exit(sig, frame)
