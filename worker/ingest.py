"""Tailing rank 0's events file into SQL, in batches, so training never waits on the database."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy import delete
from sqlmodel import Session, col

from shared.events import CheckpointEvent, MetricEvent, PlanEvent, training_event_adapter
from shared.models import Checkpoint, CheckpointKind, JobMetric
from worker.lifecycle import record_progress

logger = logging.getLogger(__name__)


class EventIngestor:
    """Reads whole new lines from ``events.jsonl`` and writes them in one transaction per poll."""

    def __init__(self, *, path: Path, job_id: uuid.UUID) -> None:
        self.path = path
        self.job_id = job_id
        self._offset = 0
        self._partial = b""

    def _read_new_lines(self) -> list[bytes]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # a line still being written has no newline yet
        return [ln for ln in lines if ln.strip()]

    def poll(self, session: Session) -> int:
        """Ingest what is new; return the number of events written."""
        events = []
        for raw in self._read_new_lines():
            try:
                events.append(training_event_adapter.validate_python(json.loads(raw)))
            except (json.JSONDecodeError, ValidationError):
                logger.warning("job %s: skipping malformed event line %r", self.job_id, raw[:200])
        if not events:
            return 0
        metrics = [e for e in events if isinstance(e, MetricEvent)]
        progress: dict[str, object] = {}
        for event in events:
            if isinstance(event, PlanEvent):
                progress["total_steps"] = event.total_steps
            elif isinstance(event, CheckpointEvent):
                session.add(
                    Checkpoint(
                        job_id=self.job_id,
                        step=event.step,
                        kind=CheckpointKind(event.kind),
                        uri=event.uri,
                        bytes=event.bytes,
                        created_at=datetime.fromisoformat(event.time),
                    )
                )
        if metrics:
            steps = [m.step for m in metrics]
            # Each step once: a step reported again (a restarted attempt) replaces the old row.
            session.execute(
                delete(JobMetric).where(col(JobMetric.job_id) == self.job_id, col(JobMetric.step).in_(steps))
            )
            by_step = {m.step: m for m in metrics}
            session.add_all(
                JobMetric(
                    job_id=self.job_id,
                    **{**m.model_dump(exclude={"type", "time"}), "time": datetime.fromisoformat(m.time)},
                )
                for m in by_step.values()
            )
            latest = metrics[-1]
            progress["step"] = latest.step
            progress["latest_metrics"] = latest.model_dump(exclude={"type"})
        if progress:
            record_progress(session=session, job_id=self.job_id, values=progress)
        session.commit()
        return len(events)
