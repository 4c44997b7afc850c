"""Publishing what a job's ranks save to the artifact store, while they train.

Ranks write DeepSpeed checkpoints and exports to the worker's disk, as before. Each one the
ingestor reads from rank 0's events is handed to this job's :class:`ArtifactPublisher`, whose
thread uploads its files (the manifest last) and then commits it in SQL
(:func:`shared.db.artifacts.commit_checkpoint`): only then does it count. The queue is bounded
by the ranks themselves: before saving the next checkpoint they wait for the previous one's
``published`` marker (:meth:`RunLayout.published_marker`), so uploads never pile up on disk
and a slow store slows training down instead.

A store that fails is retried with backoff (the job's events say so, once per outage) while
the ranks go on; at the job's end the worker gives the uploads a deadline
(``TUNEQ_ARTIFACT_UPLOAD_DEADLINE_SECONDS``) before failing the job with
``artifact_store_unavailable``. The local files stay, so a retry can finish the upload.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Literal, TypeVar

from shared.artifacts.store import ArtifactStore, StoredFile, job_key
from shared.db.artifacts import commit_checkpoint, publish_files
from shared.db.engine import session_scope
from shared.db.lifecycle import record_event
from shared.db.models import ArtifactKind, CheckpointKind, EventType
from shared.jobs.events import CheckpointEvent
from shared.jobs.run_layout import CheckpointManifest, RunLayout

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0


class PublishingStopped(Exception):
    """The publisher was told to stop (its deadline passed, or the attempt ended) mid-retry."""


class ArtifactPublisher:
    """One attempt's uploads, in order, on one thread."""

    def __init__(self, *, job_id: uuid.UUID, layout: RunLayout, store: ArtifactStore) -> None:
        self.job_id, self.layout, self.store = job_id, layout, store
        # Checkpoints, then "log" (the training log, at the end), then None (no more).
        self._queue: queue.Queue[CheckpointEvent | Literal["log"] | None] = queue.Queue()
        self._stop_at: float | None = None  # monotonic deadline for retries, once the attempt ended
        self._failing_since: float | None = None
        self.problem: str | None = None  # the store's error while it is failing
        self._thread = threading.Thread(target=self._run, name=f"publish-{job_id}", daemon=True)
        self._thread.start()

    # ---- what the worker calls -------------------------------------------------------------

    def submit(self, event: CheckpointEvent) -> None:
        """Publish a checkpoint or export the ranks have completed (its manifest is written)."""
        self._queue.put(event)

    def finish(self, *, deadline_seconds: float, log: Path | None) -> str | None:
        """Publish the training log after what is queued and wait for all of it, retrying a
        failing store for at most ``deadline_seconds``. None when everything is published,
        else what the store answered."""
        if log is not None and log.is_file():
            self._queue.put("log")
        self._queue.put(None)
        self._stop_at = time.monotonic() + deadline_seconds
        self._thread.join()
        return self.problem

    def abandon(self) -> None:
        """The attempt is over without an outcome of this worker's (lost lease, worker
        stopping): stop at the next retry; what is not committed does not count."""
        self._stop_at = time.monotonic()
        self._queue.put(None)

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if item == "log":
                    self._publish_log()
                else:
                    self._publish_checkpoint(item)
            except PublishingStopped:
                logger.warning("job %s: gave up publishing to %s: %s", self.job_id, self.store, self.problem)
                return
            except Exception:
                # Not the store's fault (a manifest that vanished, a bug): log it, go on with the next.
                logger.exception("job %s: publishing %s failed", self.job_id, getattr(item, "uri", item))

    def _publish_checkpoint(self, event: CheckpointEvent) -> None:
        directory = Path(event.uri)
        manifest = CheckpointManifest.read(directory)
        if manifest is None:
            raise FileNotFoundError(f"{directory} has no manifest")
        path_in_job = directory.relative_to(self.layout.root).as_posix()
        names = [*sorted(manifest.files), CheckpointManifest.FILENAME]  # the manifest last
        stored: list[tuple[str, StoredFile]] = []
        for name in names:
            path = f"{path_in_job}/{name}"
            stored.append((path, self._retrying(lambda: self._put(directory / name, path))))  # noqa: B023 (called at once)
        kind = CheckpointKind(event.kind)
        uri = self.store.uri_of(job_key(self.job_id, path_in_job))

        def commit() -> None:
            with session_scope() as session:
                commit_checkpoint(
                    session,
                    job_id=self.job_id,
                    kind=kind,
                    step=event.step,
                    uri=uri,
                    files=stored,
                    created_at=datetime.fromisoformat(event.time),
                )
                session.commit()

        self._retrying(commit)
        if kind == CheckpointKind.deepspeed:
            marker = self.layout.published_marker(manifest.tag)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        logger.info("job %s: published %s (%d files) to %s", self.job_id, path_in_job, len(stored), uri)

    def _publish_log(self) -> None:
        name = self.layout.log.name
        stored = self._retrying(lambda: self._put(self.layout.log, name))

        def commit() -> None:
            with session_scope() as session:
                publish_files(session, job_id=self.job_id, files=[(name, stored)], kind=ArtifactKind.log, step=None)
                session.commit()

        self._retrying(commit)

    def _put(self, source: Path, path_in_job: str) -> StoredFile:
        return self.store.put_file(source, job_key(self.job_id, path_in_job))

    def _retrying(self, action: Callable[[], T]) -> T:
        """``action`` until it succeeds, with backoff; the first failure of an outage and the
        recovery are job events."""
        delay = RETRY_FIRST_SECONDS
        while True:
            try:
                result = action()
            except Exception as e:
                self.problem = f"{type(e).__name__}: {e}"
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                    logger.warning("job %s: the artifact store %s failed (%s); retrying", self.job_id, self.store, e)
                    self._event("retrying", f"the artifact store {self.store} failed ({e}); uploads are retried")
                if self._stop_at is not None and time.monotonic() + delay > self._stop_at:
                    raise PublishingStopped from e
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            if self._failing_since is not None:
                lasted = time.monotonic() - self._failing_since
                logger.info("job %s: the artifact store is back after %.0fs", self.job_id, lasted)
                self._event("recovered", f"the artifact store {self.store} is back after {lasted:.0f}s")
                self._failing_since, self.problem = None, None
            return result

    def _event(self, state: str, message: str) -> None:
        try:
            with session_scope() as session:
                record_event(
                    session, job_id=self.job_id, type=EventType.artifact, data={"state": state, "message": message}
                )
                session.commit()
        except Exception as e:  # the database may be what is down; the worker log has it
            logger.warning("job %s: could not record the artifact event %r: %s", self.job_id, state, e)
