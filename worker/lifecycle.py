"""Job state transitions the worker makes, each one SQL statement that checks where it starts from."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from sqlalchemy import update
from sqlmodel import Session

from shared.models import Job, JobStatus, Worker, utcnow

logger = logging.getLogger(__name__)


def claim_job(*, session: Session, job_id: uuid.UUID, worker_id: str) -> Job | None:
    """Move a queued job to running for this worker, or return None if someone else has it.

    One conditional UPDATE, checked by its row count: two deliveries of the same message
    (a redelivery, a duplicate publish) can never both run the job.
    """
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.queued)  # type: ignore[arg-type]
        .values(status=JobStatus.running, started_at=utcnow(), worker_id=worker_id, attempts=Job.attempts + 1)
    )
    session.commit()
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return session.get(Job, job_id, populate_existing=True)


def finish_job(
    *,
    session: Session,
    job_id: uuid.UUID,
    status: JobStatus,
    error_code: str | None = None,
    error_message: str | None = None,
) -> bool:
    """Move a running job to a terminal status. False if it was not running any more."""
    assert status.is_terminal
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.running)  # type: ignore[arg-type]
        .values(status=status, finished_at=utcnow(), error_code=error_code, error_message=error_message)
    )
    session.commit()
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def record_progress(*, session: Session, job_id: uuid.UUID, values: dict[str, Any]) -> None:
    session.execute(update(Job).where(Job.id == job_id).values(**values))  # type: ignore[arg-type]


def register_worker(*, session: Session, worker_id: str, hostname: str, accelerator: str, device_count: int) -> None:
    worker = session.get(Worker, worker_id)
    if worker is None:
        worker = Worker(id=worker_id, hostname=hostname, accelerator=accelerator, device_count=device_count)
    worker.accelerator, worker.device_count, worker.last_seen_at = accelerator, device_count, utcnow()
    session.add(worker)
    session.commit()


def touch_worker(*, session: Session, worker_id: str) -> None:
    session.execute(update(Worker).where(Worker.id == worker_id).values(last_seen_at=utcnow()))  # type: ignore[arg-type]
    session.commit()
