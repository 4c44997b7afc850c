"""Live streams: job events as Server-Sent Events, and training logs as they are written.

SQL rows are the source of truth; a stream reads rows after its cursor, then waits for a
wake-up (Redis pub/sub when the broker is Redis) or a short poll, and ends once the job's
terminal status has been sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from anyio import to_thread
from sqlmodel import Session

from shared.db import get_engine
from shared.job_events import channel, list_events, redis_url
from shared.models import EventPublic, EventType, Job, JobStatus
from shared.storage import tail_lines

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # without Redis, how often a stream looks for new rows
SAFETY_POLL_SECONDS = 5.0  # with Redis, a missed wake-up costs at most this
HEARTBEAT_SECONDS = 15
BATCH = 500


def _status(job_id: uuid.UUID) -> JobStatus:
    with Session(get_engine()) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.status


def _read(job_id: uuid.UUID, after: int) -> tuple[list[EventPublic], JobStatus]:
    with Session(get_engine()) as session:
        events = [
            EventPublic.model_validate(e) for e in list_events(session=session, job_id=job_id, after=after, limit=BATCH)
        ]
        job = session.get(Job, job_id)
        assert job is not None
        return events, job.status


class _Waker:
    """Wait for "new events for this job" from Redis pub/sub, or just sleep without Redis."""

    def __init__(self, job_id: uuid.UUID) -> None:
        self.job_id = job_id
        self._pubsub: Any = None

    async def __aenter__(self) -> _Waker:
        url = redis_url()
        if url is not None:
            try:
                import redis.asyncio as aioredis

                self._client = aioredis.Redis.from_url(url)
                self._pubsub = self._client.pubsub()
                await self._pubsub.subscribe(channel(self.job_id))
            except Exception as e:
                logger.warning("event stream falls back to polling (redis: %s)", e)
                self._pubsub = None
        return self

    async def wait(self) -> None:
        if self._pubsub is None:
            await asyncio.sleep(POLL_SECONDS)
            return
        with contextlib.suppress(Exception):
            await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=SAFETY_POLL_SECONDS)

    async def __aexit__(self, *_exc: object) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
                await self._client.aclose()


async def event_stream(job_id: uuid.UUID, after: int) -> AsyncIterator[dict[str, Any]]:
    cursor = after
    async with _Waker(job_id) as waker:
        while True:
            events, status = await to_thread.run_sync(_read, job_id, cursor)
            for event in events:
                cursor = event.id
                yield {"id": str(event.id), "event": event.type.value, "data": event.model_dump_json()}
                if event.type == EventType.status and JobStatus(event.data["status"]).is_terminal:
                    return
            if not events and status.is_terminal:
                return  # ended before this stream's cursor; nothing more will come
            if len(events) < BATCH:
                await waker.wait()


async def follow_log(job_id: uuid.UUID, path: Path, tail: int) -> AsyncIterator[str]:
    """The last ``tail`` lines, then every new line until the job has ended."""
    for line in tail_lines(path, tail):
        yield line + "\n"
    offset = path.stat().st_size if path.exists() else 0
    partial = b""
    while True:
        chunk = b""
        if path.exists():
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()
        for raw in lines:
            yield raw.decode("utf-8", errors="replace") + "\n"
        if not chunk:
            if (await to_thread.run_sync(_status, job_id)).is_terminal:
                if partial:
                    yield partial.decode("utf-8", errors="replace") + "\n"
                return
            await asyncio.sleep(POLL_SECONDS)
