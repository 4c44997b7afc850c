"""Live streams: job events as Server-Sent Events, and training logs as the worker records them.

SQL rows are the source of truth; a stream reads rows after its cursor, then waits for a
wake-up (Redis pub/sub when the broker is Redis) or a short poll, and ends once the job's
terminal status has been sent. The streams of one job in one process, event streams and log
follows alike, share that wait and the read after it (``_JobFeed``): a log follow is the job's
events with only the ``log`` ones' lines sent.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, NamedTuple

from anyio import to_thread
from sqlalchemy import func
from sqlmodel import Session, col, select
from sse_starlette import ServerSentEvent

from shared.db.engine import get_engine
from shared.db.job_events import channel, last_log_events, list_events, redis_url
from shared.db.models import EventPublic, EventType, Job, JobEvent
from shared.jobs.status import JobStatus

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # without Redis, how often a stream looks for new rows
SAFETY_POLL_SECONDS = 5.0  # with Redis, a missed wake-up costs at most this
HEARTBEAT_SECONDS = 15
BATCH = 500
FEED_KEEP = 2000  # events a job's feed keeps for streams a little behind its head


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


class _Sent(NamedTuple):
    """One event as the streams send it, prepared once however many streams send it."""

    id: int
    message: bytes  # the SSE message, encoded
    ends_stream: bool  # the job's terminal status
    log_line: str | None  # a ``log`` event's line, what a log follow sends of it; None for other events


def _message(event: EventPublic) -> _Sent:
    ends = event.type == EventType.status and JobStatus(event.data["status"]).is_terminal
    encoded = ServerSentEvent(id=str(event.id), event=event.type.value, data=event.model_dump_json()).encode()
    log_line = event.data["line"] if event.type == EventType.log else None
    return _Sent(event.id, encoded, ends, log_line)


def _newest_event_id(session: Session, job_id: uuid.UUID) -> int:
    newest = session.exec(select(func.max(JobEvent.id)).where(col(JobEvent.job_id) == job_id)).one()
    return newest or 0


def _last_id(job_id: uuid.UUID) -> int:
    with Session(get_engine()) as session:
        return _newest_event_id(session, job_id)


def _read_log_tail(job_id: uuid.UUID, tail: int) -> tuple[list[str], int]:
    """The job's last ``tail`` log lines, and the event cursor its newer lines come after."""
    with Session(get_engine()) as session:
        # The newest id is read before the tail: a line recorded in between is in the tail and
        # at the cursor, one recorded later is after the cursor, so none is lost or sent twice.
        newest = _newest_event_id(session, job_id)
        events = last_log_events(session=session, job_id=job_id, limit=tail)
        cursor = max(newest, events[-1].id or 0) if events else newest
        return [e.data["line"] for e in events], cursor


class _JobFeed:
    """The live tail of one job's events, read once per wake-up for all of its streams in this process.

    Without it, every open stream re-read the table on every wake-up: N subscribers, N queries
    (and N Redis connections) per commit. The feed holds one Redis subscription, reads what is new
    after its ``head`` once, keeps the newest ``FEED_KEEP`` events, and wakes its streams; a stream
    whose cursor lies within what the feed holds takes its events from there. A stream behind it
    (a new one starting from 0, a resume from an old Last-Event-ID, one too slow to keep up)
    reads the table itself, as before, until it has caught up.
    """

    def __init__(self, job_id: uuid.UUID) -> None:
        self.job_id = job_id
        self.subscribers = 0
        self.status: JobStatus | None = None  # as of the last read; None until the first
        self.error: BaseException | None = None
        self.changed = asyncio.Event()  # replaced after each read that brought something
        self._floor = 0  # the feed holds every event of the job with floor < id <= head
        self._head = 0
        self._sent: list[_Sent] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def since(self, cursor: int) -> list[_Sent] | None:
        """What follows ``cursor``, or None when the feed can't tell (not read yet, or too old)."""
        if self.status is None or cursor < self._floor:
            return None
        return self._sent[bisect.bisect_right(self._sent, cursor, key=lambda m: m.id) :]

    def _wake(self) -> None:
        woken, self.changed = self.changed, asyncio.Event()
        woken.set()

    async def _run(self) -> None:
        try:
            # Subscribe before finding the head: a commit after it is then never unseen.
            async with _Waker(self.job_id) as waker:
                self._floor = self._head = await to_thread.run_sync(_last_id, self.job_id)
                while True:
                    events, status = await to_thread.run_sync(_read, self.job_id, self._head)
                    if events or status != self.status:
                        self._sent.extend(_message(e) for e in events)
                        if events:
                            self._head = events[-1].id
                        if len(self._sent) > 2 * FEED_KEEP:  # trimmed in steps, not on every read
                            self._floor = self._sent[-FEED_KEEP - 1].id
                            del self._sent[:-FEED_KEEP]
                        self.status = status
                        self._wake()
                    if len(events) < BATCH:
                        await waker.wait()
        except Exception as e:  # the feed's streams end with it, as a stream's own read error would
            logger.warning("event feed of job %s failed: %s", self.job_id, e)
            self.error = e
            self._wake()


_feeds: dict[tuple[asyncio.AbstractEventLoop, uuid.UUID], _JobFeed] = {}


@contextlib.contextmanager
def _subscribe(job_id: uuid.UUID) -> Iterator[_JobFeed]:
    """The job's feed in this event loop (started by its first stream, stopped after its last)."""
    key = (asyncio.get_running_loop(), job_id)  # asyncio objects belong to one loop (tests run several)
    feed = _feeds.get(key)
    if feed is None or feed.error is not None:
        feed = _feeds[key] = _JobFeed(job_id)
        feed.start()
    feed.subscribers += 1
    try:
        yield feed
    finally:
        feed.subscribers -= 1
        if feed.subscribers == 0:
            feed.stop()
            if _feeds.get(key) is feed:
                del _feeds[key]


async def _job_events(job_id: uuid.UUID, after: int) -> AsyncGenerator[list[_Sent], None]:
    """The job's events after ``after``, what each read brought in one list, up to and with its
    terminal status."""
    cursor = after
    with _subscribe(job_id) as feed:
        while True:
            changed = feed.changed  # taken before looking, so a read finishing meanwhile still wakes us
            if feed.error is not None:
                raise feed.error
            sent = feed.since(cursor)
            if sent is not None:
                assert feed.status is not None
                status, caught_up = feed.status, True
            else:  # behind the feed: read the table from this stream's own cursor
                events, status = await to_thread.run_sync(_read, job_id, cursor)
                sent, caught_up = [_message(e) for e in events], len(events) < BATCH
            last = next((i for i, m in enumerate(sent) if m.ends_stream), None)  # the terminal status
            if last is not None:
                sent = sent[: last + 1]
            if sent:
                cursor = sent[-1].id
                yield sent
            if last is not None:
                return
            if not sent and status.is_terminal:
                return  # ended before this stream's cursor; nothing more will come
            if caught_up:
                await changed.wait()


async def event_stream(job_id: uuid.UUID, after: int) -> AsyncIterator[bytes]:
    """SSE messages, already encoded: what one read brought goes out in one write."""
    async with contextlib.aclosing(_job_events(job_id, after)) as batches:
        async for sent in batches:
            yield b"".join(m.message for m in sent)


async def follow_log(job_id: uuid.UUID, tail: int) -> AsyncIterator[str]:
    """The job's last ``tail`` log lines, then each line the worker records, until the job's
    terminal status (every line recorded before it is sent). Lines a read brought go out in one write."""
    lines, cursor = await to_thread.run_sync(_read_log_tail, job_id, tail)
    if lines:
        yield "".join(f"{line}\n" for line in lines)
    async with contextlib.aclosing(_job_events(job_id, cursor)) as batches:
        async for sent in batches:
            if text := "".join(f"{m.log_line}\n" for m in sent if m.log_line is not None):
                yield text
