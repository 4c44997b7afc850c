"""Publishing what a job's ranks save to the artifact store, while they train.

Ranks write DeepSpeed checkpoints and exports to the worker's disk, as before. Each one the
ingestor reads from rank 0's events is handed to this job's :class:`ArtifactPublisher`, whose
thread uploads its files (the manifest last) and then commits it in SQL
(:func:`shared.db.artifacts.commit_checkpoint`): only then does it count. The queue is bounded
by the ranks themselves: before saving the next checkpoint they wait for the previous one's
``published`` marker (:meth:`RunLayout.published_marker`), so uploads never pile up on disk
and a slow store slows training down instead.

A store that fails is retried with backoff (the job's events say so, once per outage) while
the ranks go on, up to their next save. An outage longer than
``TUNEQ_ARTIFACT_UPLOAD_DEADLINE_SECONDS``, mid-run or after the ranks ended, makes the
publisher give up: the worker stops the ranks and fails the job with
``artifact_store_unavailable``. The local files stay, so a retry can finish the upload.

On each node of a multi-node job (``node``), the publisher uploads the node's share of each
DeepSpeed checkpoint (what its ranks' manifest lists: ``worker.rank.checkpointing.node_share``)
and records it; the node whose share completes the set commits the checkpoint
(:func:`shared.db.artifacts.commit_node_share`). Node 0 uploads the manifest, the exports and
the training log, and applies retention.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal, TypeVar

from shared.artifacts.store import ArtifactStore, StoredFile, StoreOutage, job_key
from shared.db.artifacts import (
    checkpoints_past_retention,
    commit_checkpoint,
    commit_node_share,
    forget_checkpoint,
    publish_files,
)
from shared.db.engine import session_scope
from shared.db.lifecycle import record_event
from shared.db.models import ArtifactKind, CheckpointKind, EventType
from shared.jobs.events import CheckpointEvent
from shared.jobs.run_layout import CheckpointManifest, RunLayout

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often finish() lets the worker renew its lease while the last uploads run.
FINISH_POLL_SECONDS = 1.0


class PublishingStopped(Exception):
    """The publisher was told to stop (its deadline passed, or the attempt ended) mid-retry."""


@dataclass(frozen=True)
class GangNode:
    """This worker's node of a multi-node job's attempt, for the publisher."""

    attempt: int
    node_rank: int
    num_nodes: int


class ArtifactPublisher:
    """One attempt's uploads, in order, on one thread."""

    def __init__(
        self,
        *,
        job_id: uuid.UUID,
        layout: RunLayout,
        store: ArtifactStore,
        deadline_seconds: float,
        keep_checkpoints: int | None,
        node: GangNode | None = None,
    ) -> None:
        self.job_id, self.layout, self.store = job_id, layout, store
        self.node = node  # None: a one-node job
        self.deadline_seconds = deadline_seconds  # the longest outage retried
        self.keep_checkpoints = keep_checkpoints  # training.keep_checkpoints; None keeps all
        # Checkpoints, then "log" (the training log, at the end), then None (no more).
        self._queue: queue.Queue[CheckpointEvent | Literal["log"] | None] = queue.Queue()
        self._abandoned = False  # the attempt ended without this worker: retry no more
        self._outage = StoreOutage()
        self.problem: str | None = None  # the store's error while it is failing
        self.gave_up = False  # an outage outlasted the deadline (or tuneq failed): nothing more is published
        self.internal = False  # it gave up on tuneq's own failure, not the store's
        self._thread = threading.Thread(target=self._run, name=f"publish-{job_id}", daemon=True)
        self._thread.start()

    # ---- what the worker calls -------------------------------------------------------------

    def submit(self, event: CheckpointEvent) -> None:
        """Publish a checkpoint or export the ranks have completed (its manifest is written)."""
        self._queue.put(event)

    def finish(self, *, log: Path | None, while_waiting: Callable[[], None] = lambda: None) -> str | None:
        """Publish the training log after what is queued and wait for all of it, calling
        ``while_waiting`` every few seconds (a final model's upload can take minutes: the
        worker keeps its lease). None when everything is published, else what the store
        answered before the publisher gave up."""
        if log is not None and log.is_file():
            self._queue.put("log")
        self._queue.put(None)
        while self._thread.is_alive():
            while_waiting()
            self._thread.join(timeout=FINISH_POLL_SECONDS)
        return self.problem if self.gave_up else None

    def abandon(self) -> None:
        """The attempt is over without an outcome of this worker's (lost lease, worker
        stopping): stop at the next retry; what is not committed does not count."""
        self._abandoned = True
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
                self.gave_up = True
                logger.warning("job %s: gave up publishing to %s: %s", self.job_id, self.store, self.problem)
                return
            except Exception as e:
                # Not the store's fault (a manifest that vanished, a bug in tuneq): the ranks would
                # wait for this checkpoint forever, so the attempt ends as tuneq's failure.
                logger.exception("job %s: publishing %s failed", self.job_id, getattr(item, "uri", item))
                self.problem, self.gave_up, self.internal = f"{type(e).__name__}: {e}", True, True
                return

    def _publish_checkpoint(self, event: CheckpointEvent) -> None:
        directory = Path(event.uri)
        manifest = CheckpointManifest.read(directory)
        if manifest is None:
            raise FileNotFoundError(f"{directory} has no manifest")
        path_in_job = directory.relative_to(self.layout.root).as_posix()
        first_node = self.node is None or self.node.node_rank == 0
        names = sorted(manifest.files)
        if first_node:
            names.append(CheckpointManifest.FILENAME)  # the manifest last
        stored: list[tuple[str, StoredFile]] = []
        for name in names:
            path = f"{path_in_job}/{name}"
            stored.append((path, self._retrying(lambda: self._put(directory / name, path))))  # noqa: B023 (called at once)
        kind = CheckpointKind(event.kind)
        uri = self.store.uri_of(job_key(self.job_id, path_in_job))

        def commit() -> None:
            with session_scope() as session:
                if self.node is not None and kind == CheckpointKind.deepspeed:
                    commit_node_share(
                        session,
                        job_id=self.job_id,
                        attempt=self.node.attempt,
                        node_rank=self.node.node_rank,
                        num_nodes=self.node.num_nodes,
                        step=event.step,
                        uri=uri,
                        files=stored,
                        created_at=datetime.fromisoformat(event.time),
                    )
                else:
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
        logger.info("job %s: published %s (%d files) to %s", self.job_id, path_in_job, len(stored), uri)
        if kind != CheckpointKind.deepspeed:
            return
        marker = self.layout.published_marker(manifest.tag)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        if self.keep_checkpoints is not None and first_node:
            self._apply_retention(self.keep_checkpoints)
        if self._store_is_elsewhere():
            self._prune_local_copies(before=event.step)

    def _store_is_elsewhere(self) -> bool:
        """The store is not this host's run directory itself (S3, or another directory): the
        local checkpoints are copies."""
        here = self.store.local_path(job_key(self.job_id, ""))
        return here is None or here.resolve() != self.layout.root.resolve()

    def drop_local_copies(self) -> list[int]:
        """Once the attempt is over on a full disk: remove this host's copies of the published
        checkpoints, where the store holds them elsewhere (the job resumes from the store, on
        any worker). The steps removed."""
        if not self._store_is_elsewhere():
            return []
        dropped = [
            step
            for step, directory in self.layout.local_checkpoints().items()
            if self.layout.published_marker(directory.name).exists()
        ]
        for step in dropped:
            self.layout.remove_local_checkpoint(step)
        return dropped

    def _apply_retention(self, keep: int) -> None:
        """Un-commit the checkpoints ``training.keep_checkpoints`` lets go, then delete their
        files from the store and this host (a crash between leaves files nobody lists)."""
        reason = f"training.keep_checkpoints is {keep}: a newer checkpoint replaces it"

        def forget() -> list[tuple[int, list[str]]]:
            with session_scope() as session:
                expired = checkpoints_past_retention(session=session, job_id=self.job_id, keep=keep)
                forgotten = [
                    (c.step, [a.path for a in forget_checkpoint(session, checkpoint=c, reason=reason)]) for c in expired
                ]
                session.commit()
                return forgotten

        for step, paths in self._retrying(forget):
            keys = [job_key(self.job_id, p) for p in paths]
            self._retrying(lambda: self.store.delete(keys))  # noqa: B023 (called at once)
            self.layout.remove_local_checkpoint(step)
            logger.info("job %s: deleted the checkpoint of step %d (%s)", self.job_id, step, reason)

    def _prune_local_copies(self, *, before: int) -> None:
        """The worker's disk is a cache of a remote store: once a checkpoint is published, the
        older local ones go (a resume takes the newest, from the store if need be)."""
        for step, directory in self.layout.local_checkpoints().items():
            if step < before and self.layout.published_marker(directory.name).exists():
                self.layout.remove_local_checkpoint(step)

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
        while True:
            try:
                result = action()
            except Exception as e:
                self.problem = f"{type(e).__name__}: {e}"
                if self._outage.failed():
                    logger.warning("job %s: the artifact store %s failed (%s); retrying", self.job_id, self.store, e)
                    self._event("retrying", f"the artifact store {self.store} failed ({e}); uploads are retried")
                if self._abandoned or self._outage.would_outlast(self.deadline_seconds):
                    raise PublishingStopped from e
                self._outage.wait()
                continue
            if (lasted := self._outage.recovered()) is not None:
                logger.info("job %s: the artifact store is back after %.0fs", self.job_id, lasted)
                self._event("recovered", f"the artifact store {self.store} is back after {lasted:.0f}s")
                self.problem = None
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
