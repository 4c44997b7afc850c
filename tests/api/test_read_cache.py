"""api.read_cache: what ``GET /jobs/{id}`` and the key look-up answer from, and when they read again."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from api.jobs_service import JobAnswer
from api.read_cache import ReadCache
from api.server_processes import ProcessChanges

T = TypeVar("T")
JobCache = ReadCache[uuid.UUID, JobAnswer]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Database:
    """A stand-in for the read: counts reads, numbers each answer, can be held until released."""

    def __init__(self, clock: Clock | None = None, *, read_takes: float = 0.0) -> None:
        self.reads = 0
        self.found = True
        self.fails = False
        self.release = threading.Event()
        self.release.set()
        self._clock = clock
        self._read_takes = read_takes

    def __call__(self, job_id: uuid.UUID) -> JobAnswer | None:
        assert self.release.wait(timeout=30)
        self.reads += 1
        if self._clock is not None:
            self._clock.now += self._read_takes
        if self.fails:
            raise RuntimeError("the database went away")
        return JobAnswer(owner="alice", body=f'{{"read":{self.reads}}}'.encode()) if self.found else None


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


JOB = uuid.uuid4()


def test_an_answer_is_kept_for_ttl_seconds_then_read_again() -> None:
    clock = Clock()
    cache, database = JobCache(clock=clock), Database()

    async def scenario() -> list[bytes]:
        bodies = []
        for advance in (0.0, 0.99, 0.02):
            clock.now += advance
            answer = await cache.read(JOB, ttl=1.0, load=database)
            assert answer is not None
            bodies.append(answer.body)
        return bodies

    assert run(scenario()) == [b'{"read":1}', b'{"read":1}', b'{"read":2}']
    assert database.reads == 2


def test_an_answers_age_counts_from_the_start_of_its_read() -> None:
    # A read that took 0.6 s gives an answer already 0.6 s old: kept 0.4 s more with ttl 1.
    clock = Clock()
    cache, database = JobCache(clock=clock), Database(clock, read_takes=0.6)

    async def scenario() -> None:
        await cache.read(JOB, ttl=1.0, load=database)
        clock.now += 0.3
        await cache.read(JOB, ttl=1.0, load=database)
        assert database.reads == 1
        clock.now += 0.2
        await cache.read(JOB, ttl=1.0, load=database)

    run(scenario())
    assert database.reads == 2


def test_requests_during_a_read_share_it() -> None:
    cache, database = JobCache(), Database()
    database.release.clear()

    async def scenario() -> list[JobAnswer | None]:
        waiting = [asyncio.ensure_future(cache.read(JOB, ttl=1.0, load=database)) for _ in range(20)]
        await asyncio.sleep(0)  # every request is now waiting on the one read
        database.release.set()
        return await asyncio.gather(*waiting)

    answers = run(scenario())
    assert database.reads == 1
    assert {a.body if a else None for a in answers} == {b'{"read":1}'}


def test_a_request_that_goes_away_leaves_the_shared_read_to_the_others() -> None:
    cache, database = JobCache(), Database()
    database.release.clear()

    async def scenario() -> JobAnswer | None:
        leaving = asyncio.ensure_future(cache.read(JOB, ttl=1.0, load=database))
        staying = asyncio.ensure_future(cache.read(JOB, ttl=1.0, load=database))
        await asyncio.sleep(0)
        leaving.cancel()
        database.release.set()
        answer = await staying
        assert leaving.cancelled()
        return answer

    answer = run(scenario())
    assert answer is not None and answer.body == b'{"read":1}' and database.reads == 1


def test_forget_makes_the_next_request_read() -> None:
    cache, database = JobCache(), Database()

    async def scenario() -> None:
        await cache.read(JOB, ttl=60.0, load=database)
        cache.forget(JOB)
        answer = await cache.read(JOB, ttl=60.0, load=database)
        assert answer is not None and answer.body == b'{"read":2}'

    run(scenario())


def test_a_read_in_flight_when_the_job_changed_here_is_not_kept() -> None:
    # Its answer may predate the change: the requests already waiting get it, later ones read again.
    cache, database = JobCache(), Database()
    database.release.clear()

    async def scenario() -> None:
        before = asyncio.ensure_future(cache.read(JOB, ttl=60.0, load=database))
        await asyncio.sleep(0)
        cache.forget(JOB)
        database.release.set()
        assert (await before) is not None
        after = await cache.read(JOB, ttl=60.0, load=database)
        assert after is not None and after.body == b'{"read":2}'

    run(scenario())
    assert len(cache) == 1


def test_a_missing_job_is_not_kept() -> None:
    cache, database = JobCache(), Database()
    database.found = False

    async def scenario() -> None:
        assert await cache.read(JOB, ttl=60.0, load=database) is None
        database.found = True  # created a moment later: found at once
        assert await cache.read(JOB, ttl=60.0, load=database) is not None

    run(scenario())
    assert database.reads == 2


def test_ttl_zero_reads_every_time() -> None:
    cache, database = JobCache(), Database()

    async def scenario() -> None:
        for _ in range(3):
            await cache.read(JOB, ttl=0.0, load=database)

    run(scenario())
    assert database.reads == 3 and len(cache) == 0


def test_a_failed_read_reaches_every_waiting_request_and_is_not_kept() -> None:
    cache, database = JobCache(), Database()
    database.release.clear()
    database.fails = True

    async def scenario() -> list[Any]:
        waiting = [asyncio.ensure_future(cache.read(JOB, ttl=60.0, load=database)) for _ in range(3)]
        await asyncio.sleep(0)
        database.release.set()
        return await asyncio.gather(*waiting, return_exceptions=True)

    assert [str(e) for e in run(scenario())] == ["the database went away"] * 3
    database.fails = False
    assert run(cache.read(JOB, ttl=60.0, load=database)) is not None
    assert database.reads == 2


def test_past_max_jobs_the_oldest_reads_go_first() -> None:
    cache, database = JobCache(max_entries=2), Database()
    first, second, third = (uuid.uuid4() for _ in range(3))

    async def scenario() -> None:
        for job_id in (first, second, third):
            await cache.read(job_id, ttl=60.0, load=database)
        assert database.reads == 3 and len(cache) == 2
        await cache.read(second, ttl=60.0, load=database)
        assert database.reads == 3
        await cache.read(first, ttl=60.0, load=database)
        assert database.reads == 4

    run(scenario())


def test_past_max_jobs_expired_answers_go_before_live_ones() -> None:
    clock = Clock()
    cache, database = JobCache(max_entries=2, clock=clock), Database()
    older_live, newer_expired, new = (uuid.uuid4() for _ in range(3))

    async def scenario() -> None:
        await cache.read(older_live, ttl=60.0, load=database)
        await cache.read(newer_expired, ttl=1.0, load=database)
        clock.now += 2
        await cache.read(new, ttl=60.0, load=database)
        await cache.read(older_live, ttl=60.0, load=database)

    run(scenario())
    assert database.reads == 3 and len(cache) == 2


class Batches:
    """A stand-in for the batched read: records each batch of keys, can be held until released."""

    def __init__(self, clock: Clock | None = None, *, read_takes: float = 0.0) -> None:
        self.batches: list[list[uuid.UUID]] = []
        self.missing: set[uuid.UUID] = set()
        self.fails_batch = 0  # the number of the batch that fails, 0 for none
        self.release = threading.Event()
        self.release.set()
        self._clock = clock
        self._read_takes = read_takes

    def __call__(self, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, JobAnswer]:
        assert self.release.wait(timeout=30)
        self.batches.append(job_ids)
        if self._clock is not None:
            self._clock.now += self._read_takes
        read = len(self.batches)
        if read == self.fails_batch:
            raise RuntimeError("the database went away")
        body = f'{{"read":{read}}}'.encode()
        return {j: JobAnswer(owner="alice", body=body) for j in job_ids if j not in self.missing}


def test_jobs_that_miss_together_are_read_in_one_batch() -> None:
    cache, database = JobCache(), Batches()
    jobs = [uuid.uuid4() for _ in range(3)]

    async def scenario() -> list[JobAnswer | None]:
        # Two requests for the first job: it is read once, in the batch with the others.
        reads = [cache.read_batched(j, ttl=60.0, load_many=database) for j in [jobs[0], *jobs]]
        return await asyncio.gather(*reads)

    answers = run(scenario())
    assert database.batches == [jobs]
    assert [a.body if a else None for a in answers] == [b'{"read":1}'] * 4
    assert len(cache) == 3


def test_jobs_that_miss_during_a_batch_are_read_in_the_next_one() -> None:
    cache, database = JobCache(), Batches()
    first, second, third = (uuid.uuid4() for _ in range(3))
    database.release.clear()

    async def scenario() -> list[JobAnswer | None]:
        reading = asyncio.ensure_future(cache.read_batched(first, ttl=60.0, load_many=database))
        await asyncio.sleep(0.05)  # the first batch is in the thread pool, held
        later = [asyncio.ensure_future(cache.read_batched(j, ttl=60.0, load_many=database)) for j in (second, third)]
        shared = asyncio.ensure_future(cache.read_batched(first, ttl=60.0, load_many=database))
        await asyncio.sleep(0)
        database.release.set()
        return await asyncio.gather(reading, shared, *later)

    answers = run(scenario())
    assert database.batches == [[first], [second, third]]
    assert [a.body if a else None for a in answers] == [b'{"read":1}', b'{"read":1}', b'{"read":2}', b'{"read":2}']


def test_a_batched_answer_is_kept_for_ttl_seconds_from_the_start_of_its_batch() -> None:
    clock = Clock()
    cache, database = JobCache(clock=clock), Batches(clock, read_takes=0.6)

    async def scenario() -> None:
        await cache.read_batched(JOB, ttl=1.0, load_many=database)
        clock.now += 0.3
        await cache.read_batched(JOB, ttl=1.0, load_many=database)
        assert len(database.batches) == 1
        clock.now += 0.2
        await cache.read_batched(JOB, ttl=1.0, load_many=database)

    run(scenario())
    assert len(database.batches) == 2


def test_a_job_a_batch_does_not_find_is_none_and_not_kept() -> None:
    cache, database = JobCache(), Batches()
    gone, there = uuid.uuid4(), uuid.uuid4()
    database.missing.add(gone)

    async def scenario() -> list[JobAnswer | None]:
        return await asyncio.gather(*(cache.read_batched(j, ttl=60.0, load_many=database) for j in (gone, there)))

    missing, found = run(scenario())
    assert missing is None and found is not None
    assert len(cache) == 1
    database.missing.clear()  # created a moment later: found at once
    assert run(cache.read_batched(gone, ttl=60.0, load_many=database)) is not None


def test_a_batched_read_in_flight_when_the_job_changed_here_is_not_kept() -> None:
    cache, database = JobCache(), Batches()
    database.release.clear()

    async def scenario() -> None:
        before = asyncio.ensure_future(cache.read_batched(JOB, ttl=60.0, load_many=database))
        await asyncio.sleep(0.05)  # in the thread pool: it may have read the job before the change
        cache.forget(JOB)
        database.release.set()
        assert (await before) is not None
        after = await cache.read_batched(JOB, ttl=60.0, load_many=database)
        assert after is not None and after.body == b'{"read":2}'

    run(scenario())
    assert len(database.batches) == 2


def test_a_job_changed_here_before_its_batch_started_is_read_after_the_change_and_kept() -> None:
    cache, database = JobCache(), Batches()
    other = uuid.uuid4()
    database.release.clear()

    async def scenario() -> None:
        running = asyncio.ensure_future(cache.read_batched(other, ttl=60.0, load_many=database))
        await asyncio.sleep(0.05)  # the first batch is held: JOB waits for the next one
        waiting = asyncio.ensure_future(cache.read_batched(JOB, ttl=60.0, load_many=database))
        await asyncio.sleep(0)
        cache.forget(JOB)
        also = asyncio.ensure_future(cache.read_batched(JOB, ttl=60.0, load_many=database))
        database.release.set()
        assert await asyncio.gather(running, waiting, also)
        kept = await cache.read_batched(JOB, ttl=60.0, load_many=database)
        assert kept is not None and kept.body == b'{"read":2}'

    run(scenario())
    assert database.batches == [[other], [JOB]]


def test_a_failed_batch_reaches_its_requests_and_is_not_kept_while_the_next_batch_reads() -> None:
    cache, database = JobCache(), Batches()
    first, second = uuid.uuid4(), uuid.uuid4()
    database.release.clear()
    database.fails_batch = 1

    async def scenario() -> list[Any]:
        failing = [asyncio.ensure_future(cache.read_batched(first, ttl=60.0, load_many=database)) for _ in range(2)]
        await asyncio.sleep(0.05)  # the first batch is held: the second job waits for the next one
        later = asyncio.ensure_future(cache.read_batched(second, ttl=60.0, load_many=database))
        await asyncio.sleep(0)
        database.release.set()
        return await asyncio.gather(*failing, later, return_exceptions=True)

    *failed, answer = run(scenario())
    assert [str(e) for e in failed] == ["the database went away"] * 2
    assert isinstance(answer, JobAnswer) and answer.body == b'{"read":2}'
    assert len(cache) == 1
    assert run(cache.read_batched(first, ttl=60.0, load_many=database)) is not None
    assert database.batches == [[first], [second], [first]]


def test_batched_ttl_zero_reads_every_time() -> None:
    cache, database = JobCache(), Batches()

    async def scenario() -> None:
        for _ in range(3):
            assert await cache.read_batched(JOB, ttl=0.0, load_many=database) is not None

    run(scenario())
    assert database.batches == [[JOB]] * 3 and len(cache) == 0


def _processes_sharing_changes() -> tuple[JobCache, JobCache]:
    """Two API processes' caches of one `tuneq serve`, sharing their count of changes as the
    server's processes do (api.server_processes)."""
    counts = multiprocessing.get_context("spawn").RawArray(ctypes.c_uint64, 2)
    first, second = JobCache(), JobCache()
    first.share_changes(ProcessChanges(counts, 0))
    second.share_changes(ProcessChanges(counts, 1))
    return first, second


def test_a_change_another_process_of_the_server_made_makes_its_kept_answers_read_again() -> None:
    first, second = _processes_sharing_changes()
    database = Batches()
    other = uuid.uuid4()

    async def scenario() -> None:
        await asyncio.gather(*(first.read_batched(j, ttl=60.0, load_many=database) for j in (JOB, other)))
        await first.read_batched(JOB, ttl=60.0, load_many=database)
        assert len(database.batches) == 1  # kept
        second.forget(JOB)  # the other process cancelled the job
        answers = await asyncio.gather(*(first.read_batched(j, ttl=60.0, load_many=database) for j in (JOB, other)))
        assert [a.body if a else None for a in answers] == [b'{"read":2}'] * 2  # every kept answer: read again
        await first.read_batched(JOB, ttl=60.0, load_many=database)
        assert len(database.batches) == 2  # and kept again

    run(scenario())


def test_a_read_in_flight_when_another_process_changed_the_job_is_not_kept() -> None:
    first, second = _processes_sharing_changes()
    database = Database()
    database.release.clear()

    async def scenario() -> None:
        before = asyncio.ensure_future(first.read(JOB, ttl=60.0, load=database))
        await asyncio.sleep(0.05)  # the read is in the thread pool, held
        second.forget(JOB)
        database.release.set()
        assert (await before) is not None  # may predate the change: the requests waiting get it
        after = await first.read(JOB, ttl=60.0, load=database)
        assert after is not None and after.body == b'{"read":2}'

    run(scenario())
