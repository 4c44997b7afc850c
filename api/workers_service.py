"""What ``GET /workers`` and ``GET /queues`` answer: the workers, the queues' waiting jobs and the
gangs waiting for nodes, as keyword-only functions over a session. No HTTP in here.

Workers and queues are the deployment's, so every owner sees them all; a job's id is shown only
to its owner and to admins' keys (another owner's running job is just "busy", a waiting gang has
no id).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from enum import StrEnum

from sqlalchemy import func
from sqlmodel import Session, SQLModel, col, select

from api.auth import Caller
from shared.db.lifecycle import ACTIVE, live_worker
from shared.db.models import Job, JobNode, NodeState, UTCDateTime, Worker, as_utc, utcnow
from shared.jobs.status import JobStatus
from shared.settings import Settings

_OPEN_NODES = (NodeState.reserved, NodeState.running)


class WorkerState(StrEnum):
    idle = "idle"  # waits for a job (or is held for a waiting gang: held_for_gang)
    busy = "busy"  # runs a job, or one node of a multi-node job
    unavailable = "unavailable"  # takes no job now: unavailable_reason says why
    stopped = "stopped"  # stopped cleanly; listed until the worker is forgotten


class WorkerPublic(SQLModel):
    id: str
    hostname: str
    accelerator: str  # "cuda" or "cpu"
    device_count: int  # GPUs, or CPU cores on a worker without GPUs
    device_memory_bytes: int | None  # its smallest device's (a CPU worker's: the host's)
    bf16_supported: bool | None
    queue: str | None  # the size queue it consumes
    state: WorkerState
    # Why it takes no job: its own reason (low disk), or no heartbeat within TUNEQ_WORKER_SEEN_SECONDS.
    unavailable_reason: str | None
    # The job it runs, when the caller owns that job; None otherwise (state still says busy).
    job_id: uuid.UUID | None
    held_for_gang: bool  # kept idle for the oldest multi-node job waiting for nodes
    started_at: UTCDateTime
    last_seen_at: UTCDateTime  # its last heartbeat
    stopped_at: UTCDateTime | None


class WorkersPublic(SQLModel):
    data: list[WorkerPublic]
    seen_seconds: int  # TUNEQ_WORKER_SEEN_SECONDS: a worker not seen for longer is unavailable


class QueuePublic(SQLModel):
    # A size queue (tuneq-2dev); None for one-node jobs no live worker fits yet, which wait unpublished.
    name: str | None
    queued: int  # one-node jobs queued on it, every owner's
    oldest_wait_seconds: float | None  # how long its oldest one has waited since it was published (or created)
    workers: int  # live workers that consume it


class GangPublic(SQLModel):
    """A multi-node job queued until enough idle workers fit it (shared.db.gangs)."""

    job_id: uuid.UUID | None  # the caller's job's id; None for another owner's
    num_nodes: int
    num_gpus: int  # per node
    held_workers: int  # idle workers kept for it (only the oldest gang holds any)
    wait_seconds: float


class QueuesPublic(SQLModel):
    data: list[QueuePublic]
    gangs: list[GangPublic]


def _running_jobs(session: Session) -> dict[str, tuple[uuid.UUID, str]]:
    """Each worker's active job (id, owner), one-node jobs and the nodes of multi-node ones alike."""
    jobs: dict[str, tuple[uuid.UUID, str]] = {}
    single = select(Job.worker_id, Job.id, Job.owner).where(
        col(Job.status).in_(ACTIVE), col(Job.worker_id).is_not(None), col(Job.num_nodes) == 1
    )
    for worker_id, job_id, owner in session.exec(single).all():
        if worker_id is not None:
            jobs[worker_id] = (job_id, owner)
    nodes = (
        select(JobNode.worker_id, Job.id, Job.owner)
        .join(Job, col(Job.id) == col(JobNode.job_id))
        .where(
            col(Job.status).in_(ACTIVE), col(JobNode.attempt) == col(Job.attempts), col(JobNode.state).in_(_OPEN_NODES)
        )
    )
    for worker_id, job_id, owner in session.exec(nodes).all():
        jobs[worker_id] = (job_id, owner)
    return jobs


def _state(
    worker: Worker, *, live: bool, running: tuple[uuid.UUID, str] | None, seen_seconds: int
) -> tuple[WorkerState, str | None]:
    if worker.stopped_at is not None:
        return WorkerState.stopped, None
    if not live:
        return WorkerState.unavailable, f"no heartbeat for more than {seen_seconds} s (TUNEQ_WORKER_SEEN_SECONDS)"
    if worker.unavailable is not None:
        return WorkerState.unavailable, worker.unavailable
    if worker.idle_since is None or running is not None:
        return WorkerState.busy, None
    return WorkerState.idle, None


def list_workers(*, session: Session, settings: Settings, caller: Caller) -> WorkersPublic:
    """Every worker the table still has (stopped ones until pruned), by queue and id."""
    since = utcnow() - timedelta(seconds=settings.worker_seen_seconds)
    running = _running_jobs(session)
    rows = session.exec(select(Worker).order_by(col(Worker.queue), col(Worker.id))).all()
    answers: list[WorkerPublic] = []
    for worker in rows:
        live = as_utc(worker.last_seen_at) >= since
        job = running.get(worker.id)
        state, reason = _state(worker, live=live, running=job, seen_seconds=settings.worker_seen_seconds)
        answers.append(
            WorkerPublic.model_validate(
                worker,
                update={
                    "state": state,
                    "unavailable_reason": reason,
                    "job_id": job[0] if job is not None and caller.sees(job[1]) else None,
                    "held_for_gang": state == WorkerState.idle and worker.gang_job_id is not None,
                },
            )
        )
    return WorkersPublic(data=answers, seen_seconds=settings.worker_seen_seconds)


def _seconds_since(value: datetime | None, now: datetime) -> float | None:
    return None if value is None else max(0.0, (now - as_utc(value)).total_seconds())


def list_queues(*, session: Session, settings: Settings, caller: Caller) -> QueuesPublic:
    """The size queues with their queued one-node jobs and live workers, and the waiting gangs."""
    now = utcnow()
    since = now - timedelta(seconds=settings.worker_seen_seconds)
    waiting_since = func.coalesce(col(Job.enqueued_at), col(Job.created_at))
    queued = session.exec(
        select(Job.queue, func.count(), func.min(waiting_since))
        .where(col(Job.status) == JobStatus.queued, col(Job.num_nodes) == 1)
        .group_by(col(Job.queue))
    ).all()
    consumers = session.exec(
        select(Worker.queue, func.count())
        .where(live_worker(since), col(Worker.queue).is_not(None))
        .group_by(col(Worker.queue))
    ).all()
    queues: dict[str | None, QueuePublic] = {
        name: QueuePublic(name=name, queued=0, oldest_wait_seconds=None, workers=count) for name, count in consumers
    }
    for name, count, oldest in queued:
        entry = queues.setdefault(name, QueuePublic(name=name, queued=0, oldest_wait_seconds=None, workers=0))
        entry.queued, entry.oldest_wait_seconds = count, _seconds_since(oldest, now)
    ordered = sorted(queues.values(), key=lambda q: (q.name is None, q.name or ""))
    return QueuesPublic(data=ordered, gangs=_waiting_gangs(session=session, caller=caller, now=now))


def _waiting_gangs(*, session: Session, caller: Caller, now: datetime) -> list[GangPublic]:
    held = dict(
        session.exec(
            select(Worker.gang_job_id, func.count())
            .where(col(Worker.gang_job_id).is_not(None), col(Worker.idle_since).is_not(None))
            .group_by(col(Worker.gang_job_id))
        ).all()
    )
    gangs = session.exec(
        select(Job)
        .where(col(Job.status) == JobStatus.queued, col(Job.num_nodes) > 1)
        .order_by(col(Job.created_at), col(Job.id))
    ).all()
    return [
        GangPublic(
            job_id=job.id if caller.sees(job.owner) else None,
            num_nodes=job.num_nodes,
            num_gpus=job.num_gpus,
            held_workers=held.get(job.id, 0),
            wait_seconds=_seconds_since(job.enqueued_at or job.created_at, now) or 0.0,
        )
        for job in gangs
    ]
