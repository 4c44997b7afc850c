"""``GET /jobs/{id}``'s answers, kept for a moment in each API process (``TUNEQ_JOB_CACHE_SECONDS``).

``GET /jobs/{id}`` is the route clients poll: dashboards, ``tuneq wait``, CI scripts, often many
of them on the same job. Reading a job from the database costs more of the server's CPU than
the rest of the request together (BENCHMARKS.md, B4), while a job's row changes at most once
per worker ingest poll. So each API process keeps the encoded answer it read last and serves it
for a short while:

- an answer is never older than ``ttl`` seconds, counted from the start of the read that made it;
- requests for a job that arrive while its read is in flight wait for that read instead of
  starting their own (one thread-pool trip and one SELECT for all of them);
- a change this process makes to a job (cancel) is seen by its next read at once (``forget``);
  a change made elsewhere (a worker, another API replica) within ``ttl``;
- only found jobs are kept: a job created a moment after a 404 is found at once;
- ``ttl`` 0 turns it off: every request reads the database.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import anyio.to_thread

# Jobs kept at most per process; past it the oldest reads go first. An entry is ~2-4 KB.
MAX_CACHED_JOBS = 10_000


@dataclass(frozen=True, slots=True)
class JobAnswer:
    """What ``GET /jobs/{id}`` answers for one job: its owner (to answer another owner 404) and
    the JSON body."""

    owner: str
    body: bytes


@dataclass(frozen=True, slots=True)
class _Entry:
    answer: JobAnswer
    expires_at: float  # on the cache's clock, time.monotonic()


class JobReadCache:
    """One API process's recent ``GET /jobs/{id}`` answers, by job id (see the module's text)."""

    def __init__(self, *, max_jobs: int = MAX_CACHED_JOBS, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_jobs = max_jobs
        self._clock = clock
        self._entries: dict[uuid.UUID, _Entry] = {}
        self._reads: dict[uuid.UUID, asyncio.Task[JobAnswer | None]] = {}

    async def read(
        self, job_id: uuid.UUID, *, ttl: float, load: Callable[[uuid.UUID], JobAnswer | None]
    ) -> JobAnswer | None:
        """The job's answer: kept, shared with a read in flight, or ``load(job_id)`` run in the
        thread pool. None when there is no such job."""
        if ttl <= 0:
            return await anyio.to_thread.run_sync(load, job_id)
        entry = self._entries.get(job_id)
        if entry is not None and entry.expires_at > self._clock():
            return entry.answer
        task = self._reads.get(job_id)
        if task is None:
            task = asyncio.ensure_future(self._load(job_id, ttl, load))
            # Its error reaches every waiting request; one left with nobody waiting is not logged
            # as "never retrieved".
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._reads[job_id] = task
        # Shielded: a client that goes away cancels its own wait, not the read others share.
        return await asyncio.shield(task)

    async def _load(
        self, job_id: uuid.UUID, ttl: float, load: Callable[[uuid.UUID], JobAnswer | None]
    ) -> JobAnswer | None:
        started = self._clock()
        try:
            answer = await anyio.to_thread.run_sync(load, job_id)
        finally:
            current = self._reads.get(job_id)
            this = asyncio.current_task()
            if current is this:
                del self._reads[job_id]
        # A forget() while this read was in flight removed it from _reads: the answer may predate
        # the change, so the requests already waiting get it but it is not kept.
        if answer is not None and current is this:
            self._keep(job_id, _Entry(answer, started + ttl))
        return answer

    def _keep(self, job_id: uuid.UUID, entry: _Entry) -> None:
        self._entries.pop(job_id, None)  # re-inserted last: dict order is the order of reads
        if len(self._entries) >= self._max_jobs:
            now = self._clock()
            for stale in [k for k, e in self._entries.items() if e.expires_at <= now]:
                del self._entries[stale]
            while len(self._entries) >= self._max_jobs:
                del self._entries[next(iter(self._entries))]
        self._entries[job_id] = entry

    def forget(self, job_id: uuid.UUID) -> None:
        """This process changed the job: its next read goes to the database."""
        self._entries.pop(job_id, None)
        self._reads.pop(job_id, None)

    def __len__(self) -> int:
        return len(self._entries)
