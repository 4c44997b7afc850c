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
- with ``read_batched``, the keys that miss together are read together: one ``load_many`` of
  all of them, in one thread-pool trip (one SELECT ... IN for many jobs), while reads of
  different keys would each take their own (``read``). Many pollers of many jobs miss a few
  hundred times a second (each job once a ``ttl``), and each job's read on its own cost ~1 ms
  of the server's CPU, three requests' worth (BENCHMARKS.md, B9);
- a change this process makes (a cancel) is seen by its next read at once (``forget``), and so
  is one that another process of the same ``tuneq serve`` makes, when the caches share a count
  of those changes (``share_changes``: ``api.server_processes`` does; any change makes every
  process read again); a change made elsewhere (a worker, another API replica, ``tuneq keys
  revoke``) within ``ttl``;
- only what was found is kept: a job or key created a moment after a miss is found at once;
- ``ttl`` 0 turns it off: every request reads the database.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import anyio.to_thread

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Entries kept at most per cache; past it the oldest reads go first. A job's is ~2-4 KB.
MAX_ENTRIES = 10_000
# Keys one load_many reads at most (the size of its SELECT ... IN); more wait for the next.
MAX_BATCH = 500


class SharedChanges(Protocol):
    """Changes the API processes of one server made, counted where all of them see the count
    (``api.server_processes.ProcessChanges``): it only grows, and each change makes it grow."""

    def count(self) -> int: ...

    def add(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Entry(Generic[V]):
    value: V
    expires_at: float  # on the cache's clock, time.monotonic()
    changes: int  # the shared count of changes when its read started (0 when none is shared)


class ReadCache(Generic[K, V]):
    """One API process's recent reads of one kind, by key (see the module's text)."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_entries = max_entries
        self._clock = clock
        self._entries: dict[K, _Entry[V]] = {}
        # The read each key's requests wait for: read()'s task, or read_batched()'s future.
        self._reads: dict[K, asyncio.Future[V | None]] = {}
        self._batch: dict[K, asyncio.Future[V | None]] = {}  # read_batched's keys not yet being read
        self._batcher: asyncio.Task[None] | None = None
        self._shared: SharedChanges | None = None

    def share_changes(self, changes: SharedChanges) -> None:
        """Count this cache's ``forget`` in ``changes``, and keep no value read before any change
        counted there: the other processes' changes are then seen at once here too."""
        self._shared = changes

    def _changes(self) -> int:
        return 0 if self._shared is None else self._shared.count()

    def _kept(self, key: K) -> _Entry[V] | None:
        entry = self._entries.get(key)
        if entry is None or entry.expires_at <= self._clock():
            return None
        return entry if self._shared is None or entry.changes == self._shared.count() else None

    async def read(self, key: K, *, ttl: float, load: Callable[[K], V | None]) -> V | None:
        """The value: kept, shared with a read in flight, or ``load(key)`` run in the thread
        pool. None when there is none."""
        if ttl <= 0:
            return await anyio.to_thread.run_sync(load, key)
        if (entry := self._kept(key)) is not None:
            return entry.value
        task = self._reads.get(key)
        if task is None:
            task = _quiet(asyncio.ensure_future(self._load(key, ttl, load)))
            self._reads[key] = task
        # Shielded: a client that goes away cancels its own wait, not the read others share.
        return await asyncio.shield(task)

    async def read_batched(self, key: K, *, ttl: float, load_many: Callable[[list[K]], Mapping[K, V]]) -> V | None:
        """As ``read``, but a key that is neither kept nor being read joins the next batch:
        ``load_many(keys)`` run in the thread pool for every key that missed meanwhile, one
        batch at a time, returning the values it found (a key it leaves out has none). Every
        ``read_batched`` of one cache must pass the same ``load_many``."""
        if ttl <= 0:
            return (await anyio.to_thread.run_sync(load_many, [key])).get(key)
        if (entry := self._kept(key)) is not None:
            return entry.value
        future = self._reads.get(key)
        if future is None:
            future = _quiet(asyncio.get_running_loop().create_future())
            self._reads[key] = self._batch[key] = future
            if self._batcher is None or self._batcher.done():
                self._batcher = asyncio.ensure_future(self._load_batches(ttl, load_many))
        return await asyncio.shield(future)

    async def _load(self, key: K, ttl: float, load: Callable[[K], V | None]) -> V | None:
        started, changes = self._clock(), self._changes()
        this = asyncio.current_task()
        try:
            value = await anyio.to_thread.run_sync(load, key)
        finally:
            current = self._ended(key, this)
        if value is not None and current:
            self._keep(key, _Entry(value, started + ttl, changes))
        return value

    async def _load_batches(self, ttl: float, load_many: Callable[[list[K]], Mapping[K, V]]) -> None:
        """Read the keys waiting in batches, until none is left."""
        while self._batch:
            keys = list(self._batch)[:MAX_BATCH]
            batch = {key: self._batch.pop(key) for key in keys}
            started, changes = self._clock(), self._changes()
            try:
                values = await anyio.to_thread.run_sync(load_many, keys)
            except BaseException as e:  # reaches every request waiting for this batch
                for key, future in batch.items():
                    self._ended(key, future)
                    if isinstance(e, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(e)
                if not isinstance(e, Exception):
                    raise
                continue
            for key, future in batch.items():
                value = values.get(key)
                if self._ended(key, future) and value is not None:
                    self._keep(key, _Entry(value, started + ttl, changes))
                future.set_result(value)

    def _ended(self, key: K, read: asyncio.Future[V | None] | None) -> bool:
        """The read of ``key`` ended: whether it is still the key's read, whose value may be
        kept. A forget() while it was in flight removed it: its value may predate the change,
        so the requests already waiting get it but it is not kept."""
        if self._reads.get(key) is read:
            del self._reads[key]
            return True
        return False

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
        """This process changed what ``key`` reads: its next read goes to the database, and so
        does every read of the processes this cache shares its changes with."""
        self._entries.pop(key, None)
        if key not in self._batch:  # a batched read not yet started reads the change: still shared
            self._reads.pop(key, None)
        if self._shared is not None:
            self._shared.add()

    def __len__(self) -> int:
        return len(self._entries)


def _quiet(read: asyncio.Future[V | None]) -> asyncio.Future[V | None]:
    """A shared read whose error reaches every waiting request: one left with nobody waiting
    (they all went away) is not logged as "never retrieved"."""
    read.add_done_callback(lambda f: f.cancelled() or f.exception())
    return read
