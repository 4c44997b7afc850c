"""Multi-node jobs: gangs of workers placed, started, renewed and released in SQL.

A job with ``num_nodes`` > 1 runs on that many workers at once, one node each. It is never
published to a size queue: ``place_gangs`` (run by the API after a submit, by a worker when it
becomes idle, and by every reconciler pass) reserves all N workers in one transaction, or none,
and only then is each reserved worker told to start its node (a message on its own queue,
``shared.queue.node_queue``). The rules (ARCHITECTURE.md, "Gang state machine"):

- **All or none.** The reservation moves the job to running (an attempt, as for a one-node
  job), writes one ``job_nodes`` row per node (worker, address, global ranks; node 0's row
  carries the rendezvous port) and marks each worker ``gang_job_id``; each of those UPDATEs is
  conditional on the worker still being idle and free, and any miss rolls the whole
  reservation back.
- **No deadlock, no starvation.** Gangs are placed oldest first. The oldest gang that cannot
  be placed yet *holds* the idle workers that fit it (they take no other job, so the workers it
  needs accumulate as running jobs end); gangs behind it hold nothing, so two gangs can never
  each hold part of what both need. A younger gang, or a one-node job, still runs on workers
  the oldest gang does not hold (backfill); the oldest gang takes every worker that becomes
  idle before anyone else, so it is placed once enough jobs end.
- **Start or release.** A node must be claimed by its worker (``claim_node``: only the worker
  it was placed on, only for that attempt, only once: a redelivered or stale message starts
  nothing) within ``TUNEQ_GANG_START_SECONDS``, and then renew its lease. A node reserved past
  that deadline, a node whose lease expired (its worker died), or a node whose ranks failed
  releases the whole gang (``release_gang``): every node row of the attempt becomes
  ``released`` (their workers see it at their next renewal and stop their ranks), the job is
  requeued or failed by ``release_job``'s rules, and the workers are free again.
"""

from __future__ import annotations

import logging
import random
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, text, update
from sqlmodel import Session, col, select

from shared.db.lifecycle import ACTIVE, live_since, live_worker, record_event, release_job
from shared.db.models import EventType, Job, JobNode, NodeState, Worker, utcnow
from shared.jobs.status import ErrorCode, JobStatus
from shared.queue import enqueue_node, node_queue
from shared.settings import Settings

logger = logging.getLogger(__name__)

# One placement at a time across every API and worker process (Postgres); on SQLite the
# database's single writer does the same.
_PLACEMENT_LOCK_KEY = 0x7475_6E65_7167  # "tuneqg"

_OPEN = (NodeState.reserved, NodeState.running)


@dataclass(frozen=True)
class NodeStart:
    """A message to send once a placement committed: start ``node_rank`` of the job's
    ``attempt`` on the worker that consumes ``queue``."""

    job_id: uuid.UUID
    attempt: int
    node_rank: int
    queue: str


def node_ranks(node: JobNode | int, num_gpus: int) -> list[int]:
    """The first and last global rank a node runs."""
    rank = node if isinstance(node, int) else node.node_rank
    return [rank * num_gpus, rank * num_gpus + num_gpus - 1]


def _row_count(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)


def _lock_placement(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PLACEMENT_LOCK_KEY})


def _pick_port(session: Session, settings: Settings, address: str) -> int:
    """A rendezvous port from TUNEQ_GANG_PORTS that no open gang with its master at
    ``address`` uses."""
    first, last = settings.gang_port_range
    taken = set(
        session.exec(
            select(JobNode.port).where(
                col(JobNode.address) == address, col(JobNode.port).is_not(None), col(JobNode.state).in_(_OPEN)
            )
        ).all()
    )
    free = [p for p in range(first, last + 1) if p not in taken]
    if not free:
        raise RuntimeError(f"every port of TUNEQ_GANG_PORTS ({first}-{last}) is in use by a gang at {address}")
    return random.choice(free)


def _free_stale_holds(session: Session) -> None:
    """Workers kept for a job that no longer waits or runs as a gang are free again."""
    waiting_or_running = select(Job.id).where(col(Job.num_nodes) > 1, col(Job.status).in_((JobStatus.queued, *ACTIVE)))
    session.execute(
        update(Worker)
        .where(col(Worker.gang_job_id).is_not(None), col(Worker.gang_job_id).not_in(waiting_or_running))
        .values(gang_job_id=None)
    )


def place_gangs(*, session: Session, settings: Settings) -> list[NodeStart]:
    """Reserve workers for the queued multi-node jobs that can start now (module docstring);
    the messages to send, each to its worker's queue, after this has committed."""
    _lock_placement(session)
    _free_stale_holds(session)
    waiting = session.exec(
        select(Job)
        .where(col(Job.status) == JobStatus.queued, col(Job.num_nodes) > 1)
        .order_by(col(Job.created_at), col(Job.id))
    ).all()
    starts: list[NodeStart] = []
    head_holds = True
    for job in waiting:
        fitting = session.exec(
            select(Worker)
            .where(
                live_worker(live_since(settings)),
                col(Worker.device_count) >= job.num_gpus,
                col(Worker.address).is_not(None),
                col(Worker.idle_since).is_not(None),
                (col(Worker.gang_job_id).is_(None)) | (col(Worker.gang_job_id) == job.id),
            )
            # Its own held workers first, then the smallest that fit (the large stay for large jobs).
            .order_by((col(Worker.gang_job_id) == job.id).desc(), col(Worker.device_count), col(Worker.id))
        ).all()
        if len(fitting) >= job.num_nodes:
            starts += _reserve(session, settings=settings, job=job, workers=list(fitting[: job.num_nodes]))
        elif head_holds:
            ids = [w.id for w in fitting]
            session.execute(update(Worker).where(col(Worker.id).in_(ids)).values(gang_job_id=job.id))
            if ids:
                logger.info("job %s waits for %d workers; holding %d", job.id, job.num_nodes, len(ids))
            head_holds = False
    session.commit()
    return starts


def _reserve(session: Session, *, settings: Settings, job: Job, workers: list[Worker]) -> list[NodeStart]:
    """One gang reserved inside the placement's transaction (all or none: a savepoint)."""
    now = utcnow()
    attempt = job.attempts + 1
    nested = session.begin_nested()
    moved = _row_count(
        session.execute(
            update(Worker)
            .where(
                col(Worker.id).in_([w.id for w in workers]),
                col(Worker.idle_since).is_not(None),
                (col(Worker.gang_job_id).is_(None)) | (col(Worker.gang_job_id) == job.id),
            )
            .values(gang_job_id=job.id)
        )
    )
    claimed = _row_count(
        session.execute(
            update(Job)
            .where(col(Job.id) == job.id, col(Job.status) == JobStatus.queued, col(Job.attempts) == job.attempts)
            .values(
                status=JobStatus.running,
                started_at=now,
                worker_id=workers[0].id,
                lease_expires_at=now + timedelta(seconds=settings.gang_start_seconds + settings.lease_ttl_seconds),
                attempts=attempt,
            )
        )
    )
    if moved != len(workers) or claimed != 1:
        nested.rollback()  # a worker took a job meanwhile, or the job moved: the next pass tries again
        return []
    deadline = now + timedelta(seconds=settings.gang_start_seconds)
    master = workers[0]
    assert master.address is not None
    port = _pick_port(session, settings, master.address)
    for rank, worker in enumerate(workers):
        assert worker.address is not None
        session.add(
            JobNode(
                job_id=job.id,
                attempt=attempt,
                node_rank=rank,
                worker_id=worker.id,
                address=worker.address,
                port=port if rank == 0 else None,
                lease_expires_at=deadline,
            )
        )
    # Workers it held beyond the ones it got are free again.
    session.execute(
        update(Worker)
        .where(col(Worker.gang_job_id) == job.id, col(Worker.id).not_in([w.id for w in workers]))
        .values(gang_job_id=None)
    )
    nodes = [{"node_rank": r, "worker_id": w.id, "address": w.address} for r, w in enumerate(workers)]
    record_event(
        session,
        job_id=job.id,
        type=EventType.status,
        data={"status": JobStatus.running.value, "attempt": attempt, "worker_id": master.id, "nodes": nodes},
    )
    nested.commit()
    logger.info(
        "job %s attempt %d placed on %s (master %s:%d)", job.id, attempt, [w.id for w in workers], master.address, port
    )
    return [NodeStart(job.id, attempt, r, node_queue(settings, w.id)) for r, w in enumerate(workers)]


def place_and_start(*, session: Session, settings: Settings) -> None:
    """A placement pass and its messages, for callers to whom placing is a courtesy (a submit,
    a worker that became idle): a pass that fails (the database busy or away) is logged and
    left to the reconcilers, which place on every pass."""
    try:
        starts = place_gangs(session=session, settings=settings)
    except Exception as e:
        session.rollback()
        logger.warning("placing multi-node jobs failed (%s); a reconciler pass will", e)
        return
    publish_node_starts(starts)


def publish_node_starts(starts: list[NodeStart]) -> None:
    """Tell each placed worker to start its node. A message the broker does not take is not
    retried here: its node is not claimed by the start deadline, and the gang is placed again."""
    for start in starts:
        try:
            enqueue_node(start.job_id, attempt=start.attempt, node_rank=start.node_rank, queue=start.queue)
        except Exception as e:
            logger.warning("job %s: could not tell node %d to start (broker: %s)", start.job_id, start.node_rank, e)


def _workers_node(
    job_id: uuid.UUID, attempt: int, node_rank: int, worker_id: str, state: NodeState
) -> list[ColumnElement[bool]]:
    """The row of node ``node_rank`` of the attempt, if it is ``worker_id``'s and in ``state``."""
    return [
        col(JobNode.job_id) == job_id,
        col(JobNode.attempt) == attempt,
        col(JobNode.node_rank) == node_rank,
        col(JobNode.worker_id) == worker_id,
        col(JobNode.state) == state,
    ]


def claim_node(
    *, session: Session, job_id: uuid.UUID, attempt: int, node_rank: int, worker_id: str, lease_ttl: float
) -> tuple[Job, list[JobNode]] | None:
    """Start this worker's node of the attempt: reserved → running, once. None when the message
    is stale (another attempt, another worker's node, already started, the gang released)."""
    now = utcnow()
    result = session.execute(
        update(JobNode)
        .where(*_workers_node(job_id, attempt, node_rank, worker_id, NodeState.reserved))
        .values(state=NodeState.running, started_at=now, lease_expires_at=now + timedelta(seconds=lease_ttl))
    )
    if _row_count(result) != 1:
        session.commit()
        return None
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    if job.attempts != attempt or job.status not in ACTIVE:
        session.rollback()
        return None
    session.commit()
    return job, gang_nodes(session=session, job_id=job_id, attempt=attempt)


def gang_nodes(*, session: Session, job_id: uuid.UUID, attempt: int) -> list[JobNode]:
    return list(
        session.exec(
            select(JobNode)
            .where(col(JobNode.job_id) == job_id, col(JobNode.attempt) == attempt)
            .order_by(col(JobNode.node_rank))
        ).all()
    )


def open_nodes(*, session: Session, job_id: uuid.UUID, attempt: int) -> list[int]:
    """The ranks of the attempt's nodes still reserved or running."""
    query = select(JobNode.node_rank).where(
        col(JobNode.job_id) == job_id, col(JobNode.attempt) == attempt, col(JobNode.state).in_(_OPEN)
    )
    return sorted(session.exec(query).all())


def current_nodes(*, session: Session, job: Job) -> list[JobNode]:
    """The nodes of a multi-node job's current attempt (none for a one-node job)."""
    if job.num_nodes <= 1 or job.attempts == 0:
        return []
    return gang_nodes(session=session, job_id=job.id, attempt=job.attempts)


def renew_node_lease(
    *, session: Session, job_id: uuid.UUID, attempt: int, node_rank: int, worker_id: str, lease_ttl: float
) -> bool:
    """Extend a running node's lease; False once its gang was released (stop the ranks)."""
    result = session.execute(
        update(JobNode)
        .where(*_workers_node(job_id, attempt, node_rank, worker_id, NodeState.running))
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_ttl))
    )
    session.commit()
    return _row_count(result) == 1


def finish_node(*, session: Session, job_id: uuid.UUID, attempt: int, node_rank: int, worker_id: str) -> None:
    """This node's ranks are gone and its worker recorded what it had to: the worker is free."""
    session.execute(
        update(JobNode)
        .where(
            col(JobNode.job_id) == job_id,
            col(JobNode.attempt) == attempt,
            col(JobNode.node_rank) == node_rank,
            col(JobNode.state).in_(_OPEN),
        )
        .values(state=NodeState.finished, finished_at=utcnow())
    )
    session.execute(
        update(Worker).where(col(Worker.id) == worker_id, col(Worker.gang_job_id) == job_id).values(gang_job_id=None)
    )
    session.commit()


def release_gang(
    *,
    session: Session,
    job: Job,
    reason: str,
    code: ErrorCode = ErrorCode.worker_lost,
    failed_node: int | None = None,
    handed_back: bool = False,
) -> JobStatus | None:
    """End an attempt of a multi-node job early, on every node: the nodes still open become
    ``released`` (their workers stop their ranks at the next renewal), the workers are free
    again, and the job is requeued or failed as ``release_job`` decides. None if another
    process already released this attempt."""
    now = utcnow()
    values: dict[str, object] = {"state": NodeState.released, "finished_at": now}
    session.execute(
        update(JobNode)
        .where(col(JobNode.job_id) == job.id, col(JobNode.attempt) == job.attempts, col(JobNode.state).in_(_OPEN))
        .values(**values)
    )
    if failed_node is not None:
        session.execute(
            update(JobNode)
            .where(
                col(JobNode.job_id) == job.id,
                col(JobNode.attempt) == job.attempts,
                col(JobNode.node_rank) == failed_node,
            )
            .values(error_message=reason[:2000])
        )
    session.execute(update(Worker).where(col(Worker.gang_job_id) == job.id).values(gang_job_id=None))
    return release_job(session=session, job=job, reason=reason, code=code, handed_back=handed_back)


def release_attempt(
    *,
    session: Session,
    job: Job,
    reason: str,
    code: ErrorCode = ErrorCode.worker_lost,
    failed_node: int | None = None,
    handed_back: bool = False,
) -> JobStatus | None:
    """End a job's attempt without an outcome of its own: a multi-node job's on every node
    (``release_gang``), a one-node job's as ``release_job`` does (``handed_back``: by a worker
    asked to stop)."""
    if job.num_nodes > 1:
        return release_gang(
            session=session, job=job, reason=reason, code=code, failed_node=failed_node, handed_back=handed_back
        )
    return release_job(session=session, job=job, reason=reason, code=code, handed_back=handed_back)


def lost_nodes(*, session: Session, now: datetime) -> list[tuple[Job, JobNode]]:
    """Open nodes of active multi-node jobs' current attempts whose lease (or start deadline)
    passed: each one's gang must be released."""
    rows = session.exec(
        select(Job, JobNode)
        .join(JobNode, col(JobNode.job_id) == col(Job.id))
        .where(
            col(Job.status).in_(ACTIVE),
            col(JobNode.attempt) == col(Job.attempts),
            col(JobNode.state).in_(_OPEN),
            col(JobNode.lease_expires_at) < now,
        )
        .order_by(col(JobNode.node_rank))
    ).all()
    return [(job, node) for job, node in rows]


def gangs_waiting(*, session: Session) -> int:
    """Multi-node jobs queued for want of enough idle workers (for /metrics)."""
    query = select(func.count()).select_from(Job).where(col(Job.status) == JobStatus.queued, col(Job.num_nodes) > 1)
    return int(session.exec(query).one())
