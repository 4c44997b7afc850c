"""What the job routes do, as keyword-only functions over a session. No HTTP in here."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from datetime import timedelta

from sqlalchemy import func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from shared.job_events import list_events
from shared.lifecycle import mark_published, record_event, request_cancel
from shared.models import Checkpoint, EventType, Job, JobEvent, JobMetric, JobStatus, Worker, utcnow
from shared.queue import enqueue_job
from shared.settings import Settings
from shared.spec import JobCreate
from shared.storage import RunLayout, tail_lines
from shared.validation import Hardware, validate_job_request

logger = logging.getLogger(__name__)


def deployment_hardware(*, session: Session, settings: Settings) -> Hardware:
    """What the workers seen lately offer; unknown (None) when none has been seen."""
    since = utcnow() - timedelta(seconds=settings.worker_seen_seconds)
    workers = session.exec(select(Worker).where(col(Worker.last_seen_at) >= since)).all()
    if not workers:
        return Hardware()
    return Hardware(
        cuda=any(w.accelerator == "cuda" for w in workers),
        max_devices=max(w.device_count for w in workers),
    )


class IdempotencyConflictError(Exception):
    """The Idempotency-Key was used before with a different body."""


def request_fingerprint(job_in: JobCreate) -> str:
    canonical = json.dumps(job_in.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _job_for_key(session: Session, key: str, fingerprint: str) -> Job | None:
    job = session.exec(select(Job).where(Job.idempotency_key == key)).first()
    if job is not None and job.request_fingerprint != fingerprint:
        raise IdempotencyConflictError(
            f"Idempotency-Key '{key}' was already used for job {job.id} with a different body: "
            "use a new key for a new job"
        )
    return job


def create_job(
    *, session: Session, job_in: JobCreate, settings: Settings, idempotency_key: str | None = None
) -> tuple[Job, bool]:
    """Validate, store and enqueue; ``(job, created)``.

    Raises JobValidationError (no row is created) or IdempotencyConflictError. The same key
    and body return the job created the first time.
    """
    fingerprint = request_fingerprint(job_in)
    if idempotency_key is not None and (existing := _job_for_key(session, idempotency_key, fingerprint)):
        return existing, False
    hardware = deployment_hardware(session=session, settings=settings)
    resolved = validate_job_request(job_in, settings=settings, hardware=hardware)
    job = Job(
        name=job_in.name,
        model=job_in.model,
        revision=job_in.revision,
        dataset=job_in.dataset,
        validation_dataset=job_in.validation_dataset,
        deepspeed_config=job_in.deepspeed_config,
        resolved_deepspeed_config=resolved,
        num_gpus=job_in.num_gpus,
        training=job_in.training.model_dump(),
        max_restarts=job_in.max_restarts,
        idempotency_key=idempotency_key,
        request_fingerprint=fingerprint,
    )
    session.add(job)
    record_event(session, job_id=job.id, type=EventType.status, data={"status": JobStatus.queued.value})
    try:
        session.commit()
    except IntegrityError:
        # Two requests with one key raced; the other one created the job.
        session.rollback()
        if idempotency_key is not None and (existing := _job_for_key(session, idempotency_key, fingerprint)):
            return existing, False
        raise
    session.refresh(job)
    try:
        enqueue_job(job.id)
        mark_published(session=session, job_id=job.id)
    except Exception as e:
        # The row is the source of truth: the reconciler publishes it once the broker is back.
        logger.warning("could not publish job %s (broker: %s); it stays queued until the broker is back", job.id, e)
    return job, True


def cancel_job(*, session: Session, job_id: uuid.UUID) -> Job:
    """Raises JobFinishedError for a job that already succeeded or failed."""
    return request_cancel(session=session, job_id=job_id)


def list_job_events(*, session: Session, job_id: uuid.UUID, after: int, limit: int) -> list[JobEvent]:
    return list_events(session=session, job_id=job_id, after=after, limit=limit)


def get_job(*, session: Session, job_id: uuid.UUID) -> Job | None:
    return session.get(Job, job_id)


def list_jobs(*, session: Session, status: JobStatus | None, skip: int, limit: int) -> tuple[list[Job], int]:
    query = select(Job)
    count_query = select(func.count()).select_from(Job)
    if status is not None:
        query = query.where(Job.status == status)
        count_query = count_query.where(Job.status == status)
    count = session.exec(count_query).one()
    jobs = session.exec(query.order_by(col(Job.created_at).desc()).offset(skip).limit(limit)).all()
    return list(jobs), int(count)


def list_metrics(*, session: Session, job_id: uuid.UUID) -> list[JobMetric]:
    query = select(JobMetric).where(JobMetric.job_id == job_id).order_by(col(JobMetric.step))
    return list(session.exec(query).all())


def list_checkpoints(*, session: Session, job_id: uuid.UUID) -> list[Checkpoint]:
    query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(col(Checkpoint.step), col(Checkpoint.kind))
    return list(session.exec(query).all())


def read_log_tail(*, settings: Settings, job_id: uuid.UUID, tail: int) -> list[str]:
    return tail_lines(RunLayout.for_job(settings, job_id).log, min(tail, settings.max_log_tail))
