"""Every job state transition, each one conditional UPDATE that names the state it leaves.

The API (submit, cancel) and the worker (claim, lease, finish, requeue) both move jobs; doing
it only here, with the status event written in the same transaction, keeps the state machine
in one place (ARCHITECTURE.md, "Job state machine").
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Engine, and_, delete, update
from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import Session, col, or_, select

# Imported for its SQLAlchemy listeners: every process that records events here (the API and the
# workers' ingest) publishes the Redis wake-ups that event streams wait on, after each commit.
import shared.db.job_events  # noqa: F401
from shared.db.models import Checkpoint, CheckpointUpload, EventType, Job, JobEvent, JobMetric, Worker, utcnow
from shared.jobs.status import ErrorCode, JobStatus
from shared.queue import size_queue
from shared.settings import Settings

logger = logging.getLogger(__name__)

# Statuses whose job has an attempt (a worker, a lease, maybe ranks).
ACTIVE = (JobStatus.running, JobStatus.cancelling, JobStatus.pausing)


class JobStateError(Exception):
    """The job is not in a status the request applies to (the API answers 409)."""


class JobFinishedError(JobStateError):
    """The job already ended; it cannot be cancelled (or paused)."""


def record_event(session: Session, *, job_id: uuid.UUID, type: EventType, data: dict[str, Any]) -> None:
    session.add(JobEvent(job_id=job_id, type=type, data=data))


def _status_event(session: Session, job_id: uuid.UUID, status: JobStatus, **data: Any) -> None:
    record_event(session, job_id=job_id, type=EventType.status, data={"status": status.value, **data})


def _moved(result: Any) -> bool:
    return bool(result.rowcount == 1)


def claim_job(*, session: Session, job_id: uuid.UUID, worker_id: str, lease_ttl: float) -> Job | None:
    """Move a queued one-node job to running for this worker, or return None if it is not
    queued, or if this worker is kept for a multi-node job (shared.db.gangs).

    One conditional UPDATE, checked by its row count: two deliveries of the same message
    (a redelivery, a republish) can never both run the job.
    """
    now = utcnow()
    kept_for_a_gang = select(Worker.id).where(col(Worker.id) == worker_id, col(Worker.gang_job_id).is_not(None))
    result = session.execute(
        update(Job)
        .where(
            col(Job.id) == job_id,
            col(Job.status) == JobStatus.queued,
            col(Job.num_nodes) == 1,
            ~kept_for_a_gang.exists(),
        )
        .values(
            status=JobStatus.running,
            started_at=now,
            worker_id=worker_id,
            lease_expires_at=now + timedelta(seconds=lease_ttl),
            attempts=col(Job.attempts) + 1,
        )
    )
    if not _moved(result):
        session.commit()  # nothing changed; a rollback would expire the caller's objects
        return None
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    _status_event(session, job_id, JobStatus.running, attempt=job.attempts, worker_id=worker_id)
    session.commit()
    return job


def renew_lease(
    *, session: Session, job_id: uuid.UUID, worker_id: str, attempt: int, lease_ttl: float
) -> JobStatus | None:
    """Extend this attempt's lease; the job's status, or None if this attempt lost the job."""
    result = session.execute(
        update(Job)
        .where(
            col(Job.id) == job_id,
            col(Job.worker_id) == worker_id,
            col(Job.attempts) == attempt,
            col(Job.status).in_(ACTIVE),
        )
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_ttl))
    )
    session.commit()
    if not _moved(result):
        return None
    return job_status(session=session, job_id=job_id)


def finish_job(
    *,
    session: Session,
    job_id: uuid.UUID,
    status: JobStatus,
    error_code: str | None = None,
    error_message: str | None = None,
    attempt: int | None = None,
) -> bool:
    """Move an active job to a terminal status. False if it was not active (or not this attempt's)."""
    assert status.is_terminal
    conditions = [col(Job.id) == job_id, col(Job.status).in_(ACTIVE)]
    if attempt is not None:
        conditions.append(col(Job.attempts) == attempt)
    result = session.execute(
        update(Job)
        .where(*conditions)
        .values(
            status=status,
            finished_at=utcnow(),
            lease_expires_at=None,
            eta_seconds=None if status == JobStatus.succeeded else Job.eta_seconds,
            error_code=error_code,
            error_message=error_message,
        )
    )
    if not _moved(result):
        session.commit()  # nothing changed; a rollback would expire the caller's objects
        return False
    error = {"code": error_code, "message": error_message} if error_code else None
    _status_event(session, job_id, status, error=error)
    session.commit()
    return True


# What a request does to a job seen in some status: the status it moves to, the other values
# it sets, and what the status event says besides the status. None: the job stays as it is.
Move = tuple[JobStatus, dict[str, Any], dict[str, Any]] | None


def _request(session: Session, job_id: uuid.UUID, what: str, decide: Callable[[Job], Move]) -> Job:
    """A user's request (cancel, pause, resume) as one conditional UPDATE from the status the
    job is seen in (``decide`` says what it does there, or raises JobStateError). The job may
    move meanwhile (claimed, finished): it is looked at again."""
    for _ in range(3):
        job = session.get(Job, job_id, populate_existing=True)
        assert job is not None
        decision = decide(job)
        if decision is None:
            return job
        target, values, event = decision
        result = session.execute(
            update(Job).where(col(Job.id) == job_id, col(Job.status) == job.status).values(status=target, **values)
        )
        if _moved(result):
            _status_event(session, job_id, target, **event)
            session.commit()
            refreshed = session.get(Job, job_id, populate_existing=True)
            assert refreshed is not None
            return refreshed
        session.commit()
    raise RuntimeError(f"job {job_id} kept changing while being {what}")


def request_cancel(*, session: Session, job_id: uuid.UUID) -> Job:
    """queued or paused → cancelled at once; running or pausing → cancelling (the worker
    finishes it); idempotent. Raises JobFinishedError for a job that succeeded or failed."""

    def decide(job: Job) -> Move:
        if job.status in (JobStatus.cancelled, JobStatus.cancelling):
            return None
        if job.status.is_terminal:
            raise JobFinishedError(
                f"job {job_id} already {job.status.value}; only queued, running or paused jobs can be cancelled"
            )
        if job.status in (JobStatus.queued, JobStatus.paused):
            message = "cancelled before it started" if job.status == JobStatus.queued else "cancelled while paused"
            values = {"finished_at": utcnow(), "error_code": ErrorCode.cancelled, "error_message": message}
            return JobStatus.cancelled, values, {}
        return JobStatus.cancelling, {}, {}

    return _request(session, job_id, "cancelled", decide)


def request_pause(*, session: Session, job_id: uuid.UUID) -> Job:
    """running → pausing (its worker has the ranks checkpoint at their next step, then
    ``finish_pause``); queued → paused at once (no attempt runs: not started yet, or between
    attempts); idempotent on a pausing or paused job. Raises JobFinishedError for a job that
    ended, JobStateError for one being cancelled."""

    def decide(job: Job) -> Move:
        if job.status in (JobStatus.pausing, JobStatus.paused):
            return None
        if job.status.is_terminal:
            raise JobFinishedError(
                f"job {job_id} already {job.status.value}; only queued or running jobs can be paused"
            )
        if job.status == JobStatus.cancelling:
            raise JobStateError(f"job {job_id} is being cancelled; only queued or running jobs can be paused")
        if job.status == JobStatus.queued:
            # A message already in the broker finds it not queued, and its claim does nothing.
            return JobStatus.paused, {"enqueued_at": None}, {"step": job.step}
        return JobStatus.pausing, {}, {}

    return _request(session, job_id, "paused", decide)


def request_resume(*, session: Session, job_id: uuid.UUID) -> Job:
    """paused → queued, unpublished: the caller publishes it as a submit does (or a reconciler
    will), and its next attempt continues from its newest checkpoint, the pause's. Raises
    JobStateError for any other status (JobFinishedError once it ended)."""

    def decide(job: Job) -> Move:
        if job.status == JobStatus.paused:
            return JobStatus.queued, {"enqueued_at": None}, {"resumed": True, "step": job.step}
        if job.status.is_terminal:
            raise JobFinishedError(f"job {job_id} already {job.status.value}; only a paused job can be resumed")
        hint = "; wait until it is paused" if job.status == JobStatus.pausing else ""
        raise JobStateError(
            f"job {job_id} is {job.status.value}; only a paused job can be resumed (POST /jobs/{job_id}/pause "
            f"pauses a queued or running one){hint}"
        )

    return _request(session, job_id, "resumed", decide)


def finish_pause(
    *, session: Session, job_id: uuid.UUID, attempt: int, step: int, checkpoint: str | None = None
) -> bool:
    """pausing → paused once the attempt's ranks are gone (and its pause checkpoint, at
    ``checkpoint``, is committed): no worker, no lease, one more pause, so this attempt is not
    counted against max_restarts. False if the job is no longer pausing in that attempt
    (cancelled meanwhile, or released)."""
    result = session.execute(
        update(Job)
        .where(col(Job.id) == job_id, col(Job.status) == JobStatus.pausing, col(Job.attempts) == attempt)
        .values(
            status=JobStatus.paused,
            worker_id=None,
            lease_expires_at=None,
            enqueued_at=None,
            eta_seconds=None,
            pauses=col(Job.pauses) + 1,
        )
    )
    if not _moved(result):
        session.commit()  # nothing changed; a rollback would expire the caller's objects
        return False
    _status_event(session, job_id, JobStatus.paused, step=step, attempt=attempt, checkpoint=checkpoint)
    session.commit()
    return True


def release_job(
    *,
    session: Session,
    job: Job,
    reason: str,
    code: ErrorCode = ErrorCode.worker_lost,
    handed_back: bool = False,
) -> JobStatus | None:
    """An attempt ended without an outcome (its worker was lost or stopped, or its host failed
    it: ``code`` host_error).

    A cancelling job becomes cancelled (never restarted); otherwise it is requeued (a pausing
    one paused: it was to stop anyway, and resumes from its newest checkpoint) while its
    attempts other than pauses and hand-backs are at most ``max_restarts``, else it fails with
    ``code`` and ``reason``. ``handed_back``: its worker was asked to stop and gave the attempt
    back; that is no failure of the job, so it is requeued whatever its restarts, and the
    attempt is counted in ``handbacks``. The UPDATE matches the attempt seen, so two
    reconcilers never both act. Returns the new status, or None.
    """
    if job.status not in ACTIVE:
        return None
    where = [
        col(Job.id) == job.id,
        col(Job.status) == job.status,
        col(Job.attempts) == job.attempts,
    ]
    values: dict[str, Any]
    restarts = job.attempts - job.pauses - job.handbacks
    if job.status == JobStatus.cancelling:
        target, values = JobStatus.cancelled, {"error_code": ErrorCode.cancelled, "error_message": "cancelled"}
    elif handed_back or restarts <= job.max_restarts:
        target = JobStatus.paused if job.status == JobStatus.pausing else JobStatus.queued
        values = {"worker_id": None, "enqueued_at": None}
        if handed_back:
            values["handbacks"] = col(Job.handbacks) + 1
    else:
        target = JobStatus.failed
        values = {
            "error_code": code,
            "error_message": f"{reason}; gave up after {job.attempts} attempts"
            + (f" ({job.pauses} of them paused)" if job.pauses else "")
            + (f" ({job.handbacks} of them handed back by a stopping worker)" if job.handbacks else "")
            + f" (max_restarts {job.max_restarts})",
        }
    if target.is_terminal:
        values["finished_at"] = utcnow()
    result = session.execute(update(Job).where(*where).values(status=target, lease_expires_at=None, **values))
    if not _moved(result):
        session.commit()  # nothing changed; a rollback would expire the caller's objects
        return None
    record_event(session, job_id=job.id, type=EventType.warning, data={"message": reason, "attempt": job.attempts})
    _status_event(
        session,
        job.id,
        target,
        error={"code": values["error_code"], "message": values["error_message"]} if target.is_terminal else None,
    )
    session.commit()
    return target


def job_status(*, session: Session, job_id: uuid.UUID) -> JobStatus:
    return JobStatus(session.exec(select(Job.status).where(Job.id == job_id)).one())


def expired_leases(*, session: Session, now: datetime) -> list[Job]:
    query = select(Job).where(col(Job.status).in_(ACTIVE), col(Job.lease_expires_at) < now)
    return list(session.exec(query).all())


def unpublished_jobs(*, session: Session, older_than: datetime, live_since: datetime) -> list[Job]:
    """Queued jobs whose message is missing: never published, or published before
    ``older_than`` to a queue whose live workers have all sat idle since before then (they
    would have taken the message had the broker still held it) or that no live worker consumes
    any more. A job waiting behind busy workers of its size is left alone."""
    live_of_its_queue = live_worker(live_since), col(Worker.queue) == col(Job.queue)
    busy_or_fresh = or_(col(Worker.idle_since).is_(None), col(Worker.idle_since) >= older_than)
    idle_consumer = select(Worker.id).where(*live_of_its_queue, ~busy_or_fresh)
    waiting_consumer = select(Worker.id).where(*live_of_its_queue, busy_or_fresh)
    lost = (col(Job.enqueued_at) < older_than) & (idle_consumer.exists() | ~waiting_consumer.exists())
    query = select(Job).where(
        col(Job.status) == JobStatus.queued,
        col(Job.num_nodes) == 1,  # gangs are placed (shared.db.gangs), never published to a size queue
        or_(col(Job.enqueued_at).is_(None), lost),
    )
    return list(session.exec(query).all())


def live_since(settings: Settings) -> datetime:
    """Workers seen since then count as live (TUNEQ_WORKER_SEEN_SECONDS)."""
    return utcnow() - timedelta(seconds=settings.worker_seen_seconds)


def running_worker(since: datetime) -> ColumnElement[bool]:
    """The ``workers`` rows of workers that run: seen since ``since`` and not stopped."""
    return and_(col(Worker.last_seen_at) >= since, col(Worker.stopped_at).is_(None))


def live_worker(since: datetime) -> ColumnElement[bool]:
    """The ``workers`` rows that count as live: running and taking jobs (not ``unavailable``).
    Only these are routed to and consume their queue."""
    return and_(running_worker(since), col(Worker.unavailable).is_(None))


def route_job(*, session: Session, settings: Settings, num_gpus: int) -> str | None:
    """The queue a job of ``num_gpus`` goes to: that of the smallest live worker size that fits.

    None while no live worker fits (none has started yet, or the large ones are gone): the
    job stays unpublished and a worker's reconciler publishes it once one is there.
    """
    sizes = session.exec(
        select(Worker.device_count).where(
            live_worker(live_since(settings)),
            col(Worker.device_count) >= num_gpus,
            col(Worker.queue).is_not(None),
        )
    ).all()
    return smallest_fitting_queue(settings, sizes=sizes, num_gpus=num_gpus)


def smallest_fitting_queue(settings: Settings, *, sizes: Iterable[int], num_gpus: int) -> str | None:
    """``route_job``'s choice among the device counts of live workers that consume a queue: the
    queue of the smallest that fits ``num_gpus``, None when none does."""
    fitting = [size for size in sizes if size >= num_gpus]
    return size_queue(settings, min(fitting)) if fitting else None


def mark_unpublished(*, session: Session, job_id: uuid.UUID) -> None:
    """A delivery that was dropped unrun: the next reconciler pass publishes the job again."""
    session.execute(
        update(Job).where(col(Job.id) == job_id, col(Job.status) == JobStatus.queued).values(enqueued_at=None)
    )
    session.commit()


def mark_published(*, session: Session, job_id: uuid.UUID, queue: str) -> None:
    session.execute(update(Job).where(col(Job.id) == job_id).values(enqueued_at=utcnow(), queue=queue))
    session.commit()


def mark_committed_job_published(*, engine: Engine, job: Job, queue: str) -> None:
    """``mark_published`` for a job its session has just committed (a submit): the UPDATE alone
    on ``engine`` (an autocommit one: no BEGIN and COMMIT around it, and no transaction left open
    on the session), and ``job``, the session's object, takes the values it wrote without being
    marked changed."""
    values = {"enqueued_at": utcnow(), "queue": queue}
    with engine.begin() as connection:
        connection.execute(update(Job).where(col(Job.id) == job.id).values(**values))
    for name, value in values.items():
        set_committed_value(job, name, value)


def record_progress(*, session: Session, job_id: uuid.UUID, values: dict[str, Any]) -> None:
    session.execute(update(Job).where(col(Job.id) == job_id).values(**values))


def rewind_job(*, session: Session, job_id: uuid.UUID, to_step: int, attempt: int, checkpoint: str | None) -> None:
    """Attempt ``attempt`` takes the running job over from the lost one before it: it resumes
    from ``checkpoint`` (the newest complete one, at ``to_step``) or starts over (None, step 0),
    so what was recorded past that step is dropped (the new attempt trains those steps again,
    and a checkpoint past it was never complete). The caller commits, with whatever it ingested
    of the lost attempt up to that step."""
    session.execute(delete(JobMetric).where(col(JobMetric.job_id) == job_id, col(JobMetric.step) > to_step))
    session.execute(delete(Checkpoint).where(col(Checkpoint.job_id) == job_id, col(Checkpoint.step) > to_step))
    # Shares of checkpoints the lost attempt's nodes never all uploaded (multi-node jobs).
    session.execute(
        delete(CheckpointUpload).where(col(CheckpointUpload.job_id) == job_id, col(CheckpointUpload.attempt) < attempt)
    )
    record_progress(session=session, job_id=job_id, values={"events_offset": 0, "step": to_step})
    if checkpoint is not None:
        record_event(
            session,
            job_id=job_id,
            type=EventType.resumed,
            data={"from_step": to_step, "attempt": attempt, "checkpoint": checkpoint},
        )


def register_worker(
    *,
    session: Session,
    worker_id: str,
    hostname: str,
    accelerator: str,
    device_count: int,
    queue: str,
    address: str | None = None,
    device_memory_bytes: int | None = None,
    bf16_supported: bool | None = None,
) -> None:
    worker = session.get(Worker, worker_id)
    if worker is None:
        worker = Worker(id=worker_id, hostname=hostname, accelerator=accelerator, device_count=device_count)
    worker.accelerator, worker.device_count, worker.queue = accelerator, device_count, queue
    worker.device_memory_bytes, worker.bf16_supported = device_memory_bytes, bf16_supported
    worker.address, worker.gang_job_id = address, None
    worker.last_seen_at = worker.idle_since = utcnow()
    worker.stopped_at = worker.unavailable = None
    session.add(worker)
    session.commit()


def stop_worker(*, session: Session, worker_id: str) -> None:
    """A worker that stops says so: it consumes no queue any more, so a job published to it
    while it waited to exit is republished (and none is held back for it)."""
    session.execute(update(Worker).where(col(Worker.id) == worker_id).values(stopped_at=utcnow()))
    session.commit()


def set_worker_unavailable(*, session: Session, worker_id: str, reason: str | None) -> None:
    """Say why a worker takes no job now (None: it takes jobs again)."""
    session.execute(update(Worker).where(col(Worker.id) == worker_id).values(unavailable=reason))
    session.commit()


def prune_workers(*, session: Session, before: datetime) -> int:
    """Forget workers not seen since ``before`` (stopped, or gone long ago): how many."""
    result = session.execute(delete(Worker).where(col(Worker.last_seen_at) < before))
    session.commit()
    return int(getattr(result, "rowcount", 0) or 0)


def set_worker_idle(*, session: Session, worker_id: str, idle: bool) -> None:
    session.execute(update(Worker).where(col(Worker.id) == worker_id).values(idle_since=utcnow() if idle else None))
    session.commit()


def touch_worker(*, session: Session, worker_id: str) -> None:
    session.execute(update(Worker).where(col(Worker.id) == worker_id).values(last_seen_at=utcnow()))
    session.commit()
