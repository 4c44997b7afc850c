"""Tailing what the ranks write into SQL, in batches, so training never waits on the database.

Rank 0's ``events-<attempt>.jsonl`` becomes metric and checkpoint rows; ``train.log`` becomes
log events. Each poll is one transaction.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import delete
from sqlmodel import Session, col, select

from shared.events import CheckpointEvent, MetricEvent, PlanEvent, training_event_adapter
from shared.lifecycle import record_event, record_progress
from shared.models import Checkpoint, CheckpointKind, EventType, JobMetric

logger = logging.getLogger(__name__)

MAX_LOG_LINES_PER_POLL = 500
MAX_LOG_LINE_CHARS = 2000


class FileTail:
    """New whole lines of a growing file; a line still being written waits for its newline."""

    def __init__(self, path: Path, *, offset: int = 0) -> None:
        self.path = path
        self._read_to = offset
        self._partial = b""

    @property
    def offset(self) -> int:
        """Where the next whole line starts: what has been consumed for good."""
        return self._read_to - len(self._partial)

    def read_lines(self) -> list[bytes]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._read_to)
            chunk = f.read()
        self._read_to += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        return lines


class EventIngestor:
    """One attempt's events (and the training log) into SQL, from where ingestion stopped.

    ``up_to_step`` replays a lost attempt's leftovers: events past the checkpoint the next
    attempt resumes from are superseded and skipped.
    """

    def __init__(
        self,
        *,
        events_path: Path,
        log_path: Path | None,
        job_id: uuid.UUID,
        events_offset: int = 0,
        log_offset: int = 0,
        up_to_step: int | None = None,
    ) -> None:
        self.job_id = job_id
        self.up_to_step = up_to_step
        self._events = FileTail(events_path, offset=events_offset)
        self._log = FileTail(log_path, offset=log_offset) if log_path is not None else None
        self._pending_log: list[bytes] = []
        self._rate_origin: tuple[int, datetime] | None = None  # (step, time) this attempt started at
        self._total_steps: int | None = None

    def poll(self, session: Session) -> int:
        """Ingest what is new; return the number of training events written."""
        events = []
        for raw in self._events.read_lines():
            if not raw.strip():
                continue
            try:
                events.append(training_event_adapter.validate_python(json.loads(raw)))
            except (json.JSONDecodeError, ValidationError):
                logger.warning("job %s: skipping malformed event line %r", self.job_id, raw[:200])
        self._ingest_log(session)
        progress: dict[str, Any] = {"events_offset": self._events.offset}
        if self._log is not None:
            progress["log_offset"] = self._log.offset - sum(len(line) + 1 for line in self._pending_log)
        metrics: dict[int, MetricEvent] = {}
        for event in events:
            superseded = self.up_to_step is not None and getattr(event, "step", 0) > self.up_to_step
            if superseded:
                continue
            if isinstance(event, PlanEvent):
                self._total_steps = progress["total_steps"] = event.total_steps
                if event.deepspeed_config is not None:
                    progress["resolved_deepspeed_config"] = event.deepspeed_config
                if event.dataset_stats is not None:
                    progress["dataset_stats"] = event.dataset_stats
                record_event(
                    session,
                    job_id=self.job_id,
                    type=EventType.plan,
                    data=event.model_dump(exclude={"type", "deepspeed_config", "dataset_stats"}),
                )
            elif isinstance(event, MetricEvent):
                metrics[event.step] = event
                record_event(
                    session, job_id=self.job_id, type=EventType.metric, data=event.model_dump(exclude={"type"})
                )
            elif isinstance(event, CheckpointEvent):
                self._record_checkpoint(session, event)
        if metrics:
            self._record_metrics(session, list(metrics.values()), progress)
        record_progress(session=session, job_id=self.job_id, values=progress)
        session.commit()
        return len(events)

    def _record_metrics(self, session: Session, metrics: list[MetricEvent], progress: dict[str, Any]) -> None:
        # Each step once: a step reported again (by a resumed attempt) replaces the old row.
        session.execute(
            delete(JobMetric).where(
                col(JobMetric.job_id) == self.job_id, col(JobMetric.step).in_([m.step for m in metrics])
            )
        )
        for m in metrics:
            fields = m.model_dump(exclude={"type", "time", "tokens_seen"})
            session.add(JobMetric(job_id=self.job_id, time=datetime.fromisoformat(m.time), **fields))
        latest = metrics[-1]
        finished = datetime.fromisoformat(latest.time)
        if self._rate_origin is None:
            self._rate_origin = (latest.step, finished)
        origin_step, origin_time = self._rate_origin
        progress.update(
            step=latest.step,
            epoch=latest.epoch,
            tokens_seen=latest.tokens_seen,
            latest_metrics=latest.model_dump(exclude={"type"}),
        )
        if self._total_steps is not None and latest.step > origin_step:
            per_step = (finished - origin_time).total_seconds() / (latest.step - origin_step)
            progress["eta_seconds"] = max(0.0, per_step * (self._total_steps - latest.step))

    def _record_checkpoint(self, session: Session, event: CheckpointEvent) -> None:
        kind = CheckpointKind(event.kind)
        known = select(Checkpoint.id).where(
            Checkpoint.job_id == self.job_id, Checkpoint.step == event.step, Checkpoint.kind == kind
        )
        if session.exec(known).first() is not None:
            return
        session.add(
            Checkpoint(
                job_id=self.job_id,
                step=event.step,
                kind=kind,
                uri=event.uri,
                bytes=event.bytes,
                created_at=datetime.fromisoformat(event.time),
            )
        )
        record_event(session, job_id=self.job_id, type=EventType.checkpoint, data=event.model_dump(exclude={"type"}))

    def _ingest_log(self, session: Session) -> None:
        if self._log is None:
            return
        self._pending_log.extend(self._log.read_lines())
        batch, self._pending_log = (
            self._pending_log[:MAX_LOG_LINES_PER_POLL],
            self._pending_log[MAX_LOG_LINES_PER_POLL:],
        )
        for raw in batch:
            line = raw.decode("utf-8", errors="replace").rstrip("\r")[:MAX_LOG_LINE_CHARS]
            # Progress bars redraw with carriage returns; keep what the line finally showed.
            line = line.rsplit("\r", 1)[-1]
            if line.strip():
                record_event(session, job_id=self.job_id, type=EventType.log, data={"line": line})
