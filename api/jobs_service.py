"""What the job routes do, as keyword-only functions over a session. No HTTP in here."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from sqlalchemy import func
from sqlmodel import Session, col, select

from shared.models import Checkpoint, Job, JobMetric, JobStatus, Worker, utcnow
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


def create_job(*, session: Session, job_in: JobCreate, settings: Settings) -> Job:
    """Validate, store and enqueue. Raises JobValidationError; creates no row then."""
    validate_job_request(job_in, settings=settings, hardware=deployment_hardware(session=session, settings=settings))
    job = Job(
        name=job_in.name,
        model=job_in.model,
        dataset=job_in.dataset,
        deepspeed_config=job_in.deepspeed_config,
        num_gpus=job_in.num_gpus,
        training=job_in.training.model_dump(),
    )
    session.add(job)
    session.commit()
    session.refresh(job)
    try:
        enqueue_job(job.id)
    except Exception:
        # The row is the source of truth; a job whose message was lost stays queued.
        logger.exception("could not publish job %s to the broker; it stays queued", job.id)
    return job


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
