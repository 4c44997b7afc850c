"""Tailing what the ranks write into SQL, in batches, so training never waits on the database.

Rank 0's ``events-<attempt>.jsonl`` becomes metric and checkpoint rows and plan, phase and warning
events; ``train.log`` becomes log events. Each poll is one transaction.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime
from operator import itemgetter
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import to_json
from sqlalchemy import JSON, Enum, Table, delete, insert
from sqlmodel import Session, SQLModel, col, select

from shared.db.job_events import wake_streams_on_commit
from shared.db.lifecycle import record_progress
from shared.db.models import EventType, JobEvent, JobMetric, utcnow
from shared.jobs.events import (
    CheckpointEvent,
    MetricEvent,
    PhaseEvent,
    PlanEvent,
    TrainingEvent,
    UploadWaitEvent,
    WarningEvent,
    training_event_adapter,
)

logger = logging.getLogger(__name__)

MAX_LOG_LINES_PER_POLL = 500
MAX_LOG_LINE_CHARS = 2000
MAX_BIND_PARAMS = 10_000  # steps per DELETE ... IN (psycopg allows 65 535 parameters, SQLite 32 766)


def _insert_rows(session: Session, model: type[SQLModel], rows: list[dict[str, Any]]) -> None:
    """Many rows in the session's transaction, at a bulk speed: COPY on Postgres, executemany elsewhere.

    An ORM object per row (and the flush's bookkeeping for each) capped ingestion at ~3 000
    events/s; even a Core executemany costs Postgres one statement per row (~20 000 rows/s).
    COPY takes the batch as one stream. Every row has the same keys; ids come from the sequence.
    """
    table: Table = model.__table__  # type: ignore[attr-defined]
    session.flush()  # rows the session holds as objects keep their place in the id order
    connection = session.connection()
    if connection.dialect.name != "postgresql":
        connection.execute(insert(table), rows)
        return
    columns = [c for c in table.columns if not c.primary_key]
    # Bound as SQLAlchemy would bind them: JSON as its text, an enum by its member's name.
    converted = [
        (i, _json_text if isinstance(c.type, JSON) else _enum_name)
        for i, c in enumerate(columns)
        if isinstance(c.type, JSON | Enum)
    ]
    values = itemgetter(*(c.name for c in columns))  # a row's values in column order, at C speed
    names = ", ".join(f'"{c.name}"' for c in columns)
    raw = connection.connection.driver_connection
    assert raw is not None
    with raw.cursor() as cursor, cursor.copy(f'COPY "{table.name}" ({names}) FROM STDIN') as copy:
        for row in rows:
            line = list(values(row))
            for i, convert in converted:
                line[i] = convert(line[i])
            copy.write_row(line)


def _json_text(value: Any) -> str:
    # pydantic-core's encoder: a fifth of json.dumps' time on a metric's data (and a NaN becomes
    # null, which a Postgres json column accepts, where json.dumps' NaN is refused).
    return to_json(value).decode()


def _enum_name(value: Any) -> str:
    return str(value.name)


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

    def mark(self) -> tuple[int, bytes]:
        """Where reading stands, for :meth:`rewind`."""
        return self._read_to, self._partial

    def rewind(self, mark: tuple[int, bytes]) -> None:
        """Read again from ``mark``: what was read since then counts as not read."""
        self._read_to, self._partial = mark

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

    A checkpoint the ranks completed is not recorded here: it counts once it is in the artifact
    store, so it goes to ``on_checkpoint`` (the attempt's publisher) after the poll that read it
    has committed. Without ``on_checkpoint`` (a lost attempt's leftovers) it is dropped: what
    that attempt's worker did not publish does not count.

    ``training_events=False`` is a node other than node 0 of a multi-node job: global rank 0
    (on node 0) reports the job's plan and metrics, so this node's worker records only its
    ranks' log lines, and hands its own checkpoint saves to its publisher. Its progress (file
    offsets) lives in memory, not on the job's row, which is node 0's.
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
        on_checkpoint: Callable[[CheckpointEvent], None] | None = None,
        training_events: bool = True,
    ) -> None:
        self.job_id = job_id
        self.training_events = training_events
        self.on_checkpoint = on_checkpoint
        self.up_to_step = up_to_step
        self._events = FileTail(events_path, offset=events_offset)
        self._log = FileTail(log_path, offset=log_offset) if log_path is not None else None
        self._pending_log: list[bytes] = []
        self._rate_origin: tuple[int, datetime] | None = None  # (step, time) this attempt started at
        self._total_steps: int | None = None
        self._now = utcnow()

    def poll(self, session: Session) -> int:
        """Ingest what is new; return the number of training events written. A poll whose
        transaction fails (the database went away) consumed nothing: the next one reads the
        same lines again."""
        saved = (self._events.mark(), self._log.mark() if self._log else None, list(self._pending_log))
        try:
            return self._poll(session)
        except BaseException:  # the caller's session rolls back as it closes
            events, log, self._pending_log = saved
            self._events.rewind(events)
            if self._log is not None and log is not None:
                self._log.rewind(log)
            raise

    def _read_events(self) -> list[TrainingEvent]:
        events: list[TrainingEvent] = []
        for raw in self._events.read_lines():
            if not raw.strip():
                continue
            try:
                # Straight from bytes: pydantic-core parses and validates in one pass.
                events.append(training_event_adapter.validate_json(raw))
            except ValidationError:  # bad JSON is a validation error too
                logger.warning("job %s: skipping malformed event line %r", self.job_id, raw[:200])
        return events

    def _poll(self, session: Session) -> int:
        events = self._read_events()
        # The poll's job_events rows, in the order things happened; written at once below.
        rows: list[dict[str, Any]] = []
        self._now = utcnow()  # created_at of the poll's rows: they are committed together
        self._ingest_log(rows)
        progress: dict[str, Any] = {"events_offset": self._events.offset}
        if self._log is not None:
            progress["log_offset"] = self._log.offset - sum(len(line) + 1 for line in self._pending_log)
        metrics: dict[int, dict[str, Any]] = {}  # step -> the step's last report in this poll
        checkpoints: list[CheckpointEvent] = []
        for event in events:
            superseded = self.up_to_step is not None and getattr(event, "step", 0) > self.up_to_step
            if superseded or not (self.training_events or isinstance(event, CheckpointEvent)):
                continue
            if isinstance(event, PlanEvent):
                self._total_steps = progress["total_steps"] = event.total_steps
                if event.deepspeed_config is not None:
                    progress["resolved_deepspeed_config"] = event.deepspeed_config
                if event.dataset_stats is not None:
                    progress["dataset_stats"] = event.dataset_stats
                data = event.model_dump(exclude={"type", "deepspeed_config", "dataset_stats"})
                rows.append(self._event_row(EventType.plan, data))
            elif isinstance(event, MetricEvent):
                # A flat model of plain values: its __dict__ is its model_dump(), at a tenth of the cost.
                data = event.__dict__.copy()
                del data["type"]
                metrics[event.step] = data
                rows.append(self._event_row(EventType.metric, data))
            elif isinstance(event, CheckpointEvent):
                checkpoints.append(event)
            elif isinstance(event, UploadWaitEvent):
                message = (
                    f"training waits before saving step {event.step}: the checkpoint of step "
                    f"{event.waiting_for} is still being uploaded to the artifact store"
                )
                rows.append(self._event_row(EventType.artifact, {"state": "waiting", "message": message}))
            elif isinstance(event, WarningEvent):
                rows.append(self._event_row(EventType.warning, {"message": event.message}))
            elif isinstance(event, PhaseEvent):
                # Each report is an event; the job shows the latest (a poll's last) as its phase.
                data = event.model_dump(exclude={"type"})
                progress["phase"] = data
                rows.append(self._event_row(EventType.phase, data))
        if metrics:
            self._record_metrics(session, list(metrics.values()), progress)
        if rows:
            _insert_rows(session, JobEvent, rows)
            wake_streams_on_commit(session, self.job_id)  # COPY rows pass no ORM flush
        if self.training_events:
            record_progress(session=session, job_id=self.job_id, values=progress)
        session.commit()
        if self.on_checkpoint is not None:
            for checkpoint in checkpoints:
                self.on_checkpoint(checkpoint)
        return len(events)

    def _event_row(self, type: EventType, data: dict[str, Any]) -> dict[str, Any]:
        # created_at is set here: the model's default_factory is not run by a Core insert.
        return {"job_id": self.job_id, "type": type, "data": data, "created_at": self._now}

    def _metric_row(self, data: dict[str, Any]) -> dict[str, Any]:
        row = data.copy()
        del row["tokens_seen"]  # the job's running total, not a job_metrics column
        row["job_id"], row["time"] = self.job_id, datetime.fromisoformat(data["time"])
        return row

    def _record_metrics(self, session: Session, metrics: list[dict[str, Any]], progress: dict[str, Any]) -> None:
        # Each step once: a step reported again (by a resumed attempt) replaces the old row. Most
        # polls bring only new steps, so look for stored ones first (one indexed range read)
        # rather than send a DELETE naming every step of the batch.
        steps = [m["step"] for m in metrics]
        stored = session.exec(
            select(JobMetric.step).where(
                col(JobMetric.job_id) == self.job_id, col(JobMetric.step).between(min(steps), max(steps))
            )
        ).all()
        replaced = sorted(set(stored).intersection(steps))
        for i in range(0, len(replaced), MAX_BIND_PARAMS):  # under the drivers' bound-parameter limits
            session.execute(
                delete(JobMetric).where(
                    col(JobMetric.job_id) == self.job_id, col(JobMetric.step).in_(replaced[i : i + MAX_BIND_PARAMS])
                )
            )
        _insert_rows(session, JobMetric, [self._metric_row(m) for m in metrics])
        latest = metrics[-1]
        finished = datetime.fromisoformat(latest["time"])
        if self._rate_origin is None:
            self._rate_origin = (latest["step"], finished)
        origin_step, origin_time = self._rate_origin
        progress.update(
            step=latest["step"],
            epoch=latest["epoch"],
            tokens_seen=latest["tokens_seen"],
            latest_metrics=latest,
        )
        if self._total_steps is not None and latest["step"] > origin_step:
            per_step = (finished - origin_time).total_seconds() / (latest["step"] - origin_step)
            progress["eta_seconds"] = max(0.0, per_step * (self._total_steps - latest["step"]))

    def _ingest_log(self, rows: list[dict[str, Any]]) -> None:
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
                rows.append(self._event_row(EventType.log, {"line": line}))
