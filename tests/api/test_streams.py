"""The job event feed behind the SSE streams and log follows: one read per wake-up for every stream of a job."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from sqlmodel import Session

from api import streams
from shared.db.engine import get_engine
from shared.db.lifecycle import record_event
from shared.db.models import EventPublic, EventType
from shared.jobs.status import JobStatus
from tests.shared.db.test_lifecycle import new_job


def add_events(job_id: uuid.UUID, *data: dict[str, Any], type: EventType = EventType.metric) -> None:
    with Session(get_engine()) as session:
        for d in data:
            record_event(session, job_id=job_id, type=type, data=d)
        session.commit()


class Harness:
    """Wake-ups on demand (instead of Redis or the poll timer), and every table read counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[int] = []  # the cursor of each read
        self.wake_ups: asyncio.Queue[None] | None = None
        read = streams._read

        def counted(job_id: uuid.UUID, after: int) -> tuple[list[EventPublic], JobStatus]:
            self.reads.append(after)
            return read(job_id, after)

        async def wait(_waker: object) -> None:
            assert self.wake_ups is not None
            await self.wake_ups.get()

        monkeypatch.setattr(streams, "_read", counted)
        monkeypatch.setattr(streams._Waker, "wait", wait)

    def wake(self) -> None:
        assert self.wake_ups is not None
        self.wake_ups.put_nowait(None)


def parse(chunk: bytes) -> list[dict[str, str]]:
    """SSE messages, as sse-starlette encodes them (fields split by CRLF, messages by a blank line)."""
    messages = []
    for block in chunk.decode().split("\r\n\r\n"):
        if block:
            messages.append(dict(line.split(": ", 1) for line in block.split("\r\n")))
    return messages


class Reader:
    """A stream's messages one at a time, however many arrive in one write."""

    def __init__(self, stream: AsyncIterator[bytes]) -> None:
        self.stream = stream
        self.pending: list[dict[str, str]] = []

    async def take(self, n: int) -> list[int]:
        while len(self.pending) < n:
            self.pending += parse(await asyncio.wait_for(anext(self.stream), timeout=30))
        taken, self.pending = self.pending[:n], self.pending[n:]
        return [int(m["id"]) for m in taken]

    async def drain(self) -> list[str]:
        return [m["event"] for chunk in [c async for c in self.stream] for m in parse(chunk)]

    async def aclose(self) -> None:
        await self.stream.aclose()


def follow(job_id: uuid.UUID, after: int = 0) -> Reader:
    return Reader(streams.event_stream(job_id, after))


async def settle(until: Callable[[], bool] | None = None) -> None:
    """Let the feed's task run (its reads are in a worker thread): until ``until``, or for a moment."""
    if until is None:
        await asyncio.sleep(0.1)
        return
    for _ in range(3000):
        if until():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the streams did not get there")


def run(harness: Harness, main: Callable[[], Awaitable[None]]) -> None:
    async def wrapped() -> None:
        harness.wake_ups = asyncio.Queue()
        await main()

    asyncio.run(wrapped())


def test_streams_of_one_job_share_one_read_per_wake_up(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job = new_job()
    add_events(job.id, {"step": 1})
    harness = Harness(monkeypatch)

    async def main() -> None:
        subscribers = [follow(job.id) for _ in range(5)]
        # Each new stream catches up on its own (its cursor is behind the feed's start)...
        firsts = [await s.take(1) for s in subscribers]
        assert len({tuple(f) for f in firsts}) == 1
        waiting = [asyncio.ensure_future(s.take(2)) for s in subscribers]
        await settle(lambda: len(harness.reads) >= 6)  # five catch-ups, then the feed's first read
        await settle()
        before = len(harness.reads)
        add_events(job.id, {"step": 2}, {"step": 3})
        harness.wake()
        received = await asyncio.gather(*waiting)
        # ...then one read of the table serves every stream of the job.
        assert len(harness.reads) - before == 1
        assert len({tuple(r) for r in received}) == 1 and received[0] == sorted(received[0])
        for s in subscribers:
            await s.aclose()
        assert not streams._feeds  # the last stream out stopped the feed

    run(harness, main)


def test_a_resumed_stream_within_the_feed_reads_nothing_itself(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = new_job()
    harness = Harness(monkeypatch)

    async def main() -> None:
        live = follow(job.id)
        first = asyncio.ensure_future(live.take(3))
        await settle(lambda: len(harness.reads) >= 2)
        await settle()
        add_events(job.id, {"step": 1}, {"step": 2}, {"step": 3})
        harness.wake()
        ids = await first
        reads = len(harness.reads)
        # A reconnect with Last-Event-ID = the first id gets the rest from the feed, not the table.
        resumed = follow(job.id, ids[0])
        assert await resumed.take(2) == ids[1:]
        assert len(harness.reads) == reads
        await resumed.aclose()
        await live.aclose()

    run(harness, main)


def test_a_stream_behind_the_feeds_window_reads_the_rest_itself_in_order(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = new_job()
    monkeypatch.setattr(streams, "FEED_KEEP", 2)
    harness = Harness(monkeypatch)

    async def main() -> None:
        fast, slow = follow(job.id), follow(job.id)
        fast_ids = asyncio.ensure_future(fast.take(12))
        slow_first = asyncio.ensure_future(slow.take(1))
        await settle(lambda: len(harness.reads) >= 3)
        await settle()
        for step in range(12):  # more than the feed keeps while `slow` is not reading
            reads = len(harness.reads)
            add_events(job.id, {"step": step})
            harness.wake()
            await settle(lambda reads=reads: len(harness.reads) > reads)  # the feed's one read
            await settle()
        got_fast = await fast_ids
        got_slow = [*(await slow_first), *(await slow.take(11))]
        assert got_slow == got_fast == sorted(got_fast)
        await fast.aclose()
        await slow.aclose()

    run(harness, main)


def test_streams_end_after_the_terminal_status(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job = new_job()
    harness = Harness(monkeypatch)

    async def main() -> None:
        drained = [asyncio.ensure_future(follow(job.id).drain()) for _ in range(2)]
        await settle(lambda: len(harness.reads) >= 3)
        await settle()
        add_events(job.id, {"step": 1})
        add_events(job.id, {"status": JobStatus.succeeded.value}, type=EventType.status)
        harness.wake()
        assert await asyncio.wait_for(asyncio.gather(*drained), timeout=30) == [["metric", "status"]] * 2
        assert not streams._feeds

    run(harness, main)


def test_a_log_follow_shares_the_jobs_feed_and_sends_its_log_lines(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = new_job()
    add_events(job.id, {"line": "first"}, {"line": "second"}, type=EventType.log)
    add_events(job.id, {"step": 1})
    harness = Harness(monkeypatch)

    async def main() -> None:
        events = follow(job.id)
        logs = streams.follow_log(job.id, 1)
        assert await asyncio.wait_for(anext(logs), timeout=30) == "second\n"  # the tail, from SQL
        assert len(await events.take(3)) == 3
        next_lines = asyncio.ensure_future(anext(logs))
        next_events = asyncio.ensure_future(events.take(3))
        await settle(lambda: len(harness.reads) >= 2)  # until both streams wait on the feed
        await settle()
        before = len(harness.reads)
        add_events(job.id, {"line": "a"}, type=EventType.log)
        add_events(job.id, {"step": 2})
        add_events(job.id, {"line": "b"}, type=EventType.log)
        harness.wake()
        assert await asyncio.wait_for(next_lines, timeout=30) == "a\nb\n"  # what one read brought, in one write
        assert len(await next_events) == 3
        assert len(harness.reads) - before == 1  # one read of the table for both streams
        add_events(job.id, {"status": JobStatus.failed.value}, type=EventType.status)
        add_events(job.id, {"line": "after the end"}, type=EventType.log)
        harness.wake()
        assert [line async for line in logs] == []  # ends with the job, without the line after it
        assert await asyncio.wait_for(events.drain(), timeout=30) == ["status"]
        assert not streams._feeds

    run(harness, main)
