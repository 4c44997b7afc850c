"""Reading a job's events, and waking live streams when new ones are committed.

SQL rows are the source of truth. With a Redis broker, every commit that adds events also
publishes the job id on a Redis channel, so streams wake at once instead of polling; with the
embedded broker, streams poll the table.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session as OrmSession
from sqlmodel import Session, col, select

from shared.db.models import EventType, JobEvent
from shared.settings import get_settings

logger = logging.getLogger(__name__)

CHANNEL_PREFIX = "tuneq:job-events:"


def channel(job_id: uuid.UUID | str) -> str:
    return f"{CHANNEL_PREFIX}{job_id}"


def list_events(
    *, session: Session, job_id: uuid.UUID, after: int, limit: int, types: Sequence[EventType] | None = None
) -> list[JobEvent]:
    """The job's events after the id ``after``, oldest first, at most ``limit``; of ``types`` only
    when given (a page then skips the other types' ids)."""
    query = select(JobEvent).where(col(JobEvent.job_id) == job_id, col(JobEvent.id) > after)
    if types:
        query = query.where(col(JobEvent.type).in_(types))
    return list(session.exec(query.order_by(col(JobEvent.id)).limit(limit)).all())


def newest_events(
    *, session: Session, job_id: uuid.UUID, types: Sequence[EventType], before: int | None, limit: int
) -> list[JobEvent]:
    """The job's newest ``limit`` events of ``types`` (older than the id ``before``), newest
    first: one query along the ``(job_id, id)`` index from the newest down, however long the
    job's history."""
    query = select(JobEvent).where(col(JobEvent.job_id) == job_id, col(JobEvent.type).in_(types))
    if before is not None:
        query = query.where(col(JobEvent.id) < before)
    return list(session.exec(query.order_by(col(JobEvent.id).desc()).limit(limit)).all())


def last_log_events(*, session: Session, job_id: uuid.UUID, limit: int) -> list[JobEvent]:
    """The job's newest ``limit`` log lines (``log`` events), oldest first, without reading the
    job's whole log."""
    newest = newest_events(session=session, job_id=job_id, types=(EventType.log,), before=None, limit=limit)
    return list(reversed(newest))


def redis_url() -> str | None:
    url = get_settings().broker_url
    return url if url.startswith(("redis://", "rediss://")) else None


@lru_cache
def _redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)


_PENDING = "tuneq_event_jobs"  # session.info key: jobs whose streams the next commit wakes


def wake_streams_on_commit(session: OrmSession, job_id: uuid.UUID) -> None:
    """Have the session's next commit wake this job's streams.

    New ``JobEvent`` objects do so by themselves (found in the flush); rows written with a Core
    insert or COPY never pass through a flush, so their writer names the job here.
    """
    session.info.setdefault(_PENDING, set()).add(job_id)


def _collect_job_ids(session: OrmSession, _flush_context: Any) -> None:
    for job_id in {obj.job_id for obj in session.new if isinstance(obj, JobEvent)}:
        wake_streams_on_commit(session, job_id)


def _publish_after_commit(session: OrmSession) -> None:
    ids = session.info.pop(_PENDING, None)
    url = redis_url()
    if not ids or url is None:
        return
    try:
        client = _redis_client(url)
        for job_id in ids:
            client.publish(channel(job_id), "1")
    except Exception as e:  # a missed wake-up only delays a stream until its next poll
        logger.debug("could not publish event wake-up: %s", e)


def _forget_on_rollback(session: OrmSession) -> None:
    session.info.pop(_PENDING, None)


event.listen(OrmSession, "before_flush", lambda s, ctx, _instances: _collect_job_ids(s, ctx))
event.listen(OrmSession, "after_commit", _publish_after_commit)
event.listen(OrmSession, "after_soft_rollback", lambda s, _tx: _forget_on_rollback(s))
