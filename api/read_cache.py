"""Database reads that requests share, kept for a moment in each API process.

Two reads run on nearly every request of a busy API: ``GET /jobs/{id}``'s read of the job (the
route clients poll: dashboards, ``tuneq wait``, CI scripts, often many on the same job) and,
with keys on, the look-up of the caller's key. Each costs more of the server's CPU than the
rest of the request together (BENCHMARKS.md, B4), while what it reads changes seldom (a job
once per worker ingest poll, a key when it is revoked). So each API process keeps what it read
and answers from it for a short while (``TUNEQ_JOB_CACHE_SECONDS``, ``TUNEQ_KEY_CACHE_SECONDS``):

- a value is never older than ``ttl`` seconds, counted from the start of the read that made it;
- requests for a key that arrive while its read is in flight wait for that read instead of
  starting their own (one thread-pool trip and one SELECT for all of them);
- a change this process makes (a cancel) is seen by its next read at once (``forget``); a
  change made elsewhere (a worker, another API replica, ``tuneq keys revoke``) within ``ttl``;
- only what was found is kept: a job or key created a moment after a miss is found at once;
- ``ttl`` 0 turns it off: every request reads the database.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio.to_thread

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Entries kept at most per cache; past it the oldest reads go first. A job's is ~2-4 KB.
MAX_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class _Entry(Generic[V]):
    value: V
    expires_at: float  # on the cache's clock, time.monotonic()


class ReadCache(Generic[K, V]):
    """One API process's recent reads of one kind, by key (see the module's text)."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_entries = max_entries
        self._clock = clock
        self._entries: dict[K, _Entry[V]] = {}
        self._reads: dict[K, asyncio.Task[V | None]] = {}

    async def read(self, key: K, *, ttl: float, load: Callable[[K], V | None]) -> V | None:
        """The value: kept, shared with a read in flight, or ``load(key)`` run in the thread
        pool. None when there is none."""
        if ttl <= 0:
            return await anyio.to_thread.run_sync(load, key)
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at > self._clock():
            return entry.value
        task = self._reads.get(key)
        if task is None:
            task = asyncio.ensure_future(self._load(key, ttl, load))
            # Its error reaches every waiting request; one left with nobody waiting is not logged
            # as "never retrieved".
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._reads[key] = task
        # Shielded: a client that goes away cancels its own wait, not the read others share.
        return await asyncio.shield(task)

    async def _load(self, key: K, ttl: float, load: Callable[[K], V | None]) -> V | None:
        started = self._clock()
        try:
            value = await anyio.to_thread.run_sync(load, key)
        finally:
            current = self._reads.get(key)
            this = asyncio.current_task()
            if current is this:
                del self._reads[key]
        # A forget() while this read was in flight removed it from _reads: the value may predate
        # the change, so the requests already waiting get it but it is not kept.
        if value is not None and current is this:
            self._keep(key, _Entry(value, started + ttl))
        return value

    def _keep(self, key: K, entry: _Entry[V]) -> None:
        self._entries.pop(key, None)  # re-inserted last: dict order is the order of reads
        if len(self._entries) >= self._max_entries:
            now = self._clock()
            for stale in [k for k, e in self._entries.items() if e.expires_at <= now]:
                del self._entries[stale]
            while len(self._entries) >= self._max_entries:
                del self._entries[next(iter(self._entries))]
        self._entries[key] = entry

    def forget(self, key: K) -> None:
        """This process changed what ``key`` reads: its next read goes to the database."""
        self._entries.pop(key, None)
        self._reads.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)
