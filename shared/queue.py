"""The Celery app both sides share: the API publishes job ids, workers consume them.

Settings fit hours-long tasks on exclusive GPUs (see ARCHITECTURE.md, "Why these Celery
settings"): one job per worker process, no prefetching, late acks, and the database, not the
broker, decides whether a delivered job runs.
"""

from __future__ import annotations

import logging
import time
import uuid
from functools import lru_cache

from celery import Celery

from shared.settings import Settings, get_settings

logger = logging.getLogger(__name__)

RUN_JOB_TASK = "tuneq.run_job"
# One node of a multi-node job, sent to the worker it was placed on (shared.db.gangs).
RUN_NODE_TASK = "tuneq.run_node"


def redis_transport_options(settings: Settings) -> dict[str, float]:
    """Hours-long tasks: Redis must not redeliver while a task still runs, so the visibility
    timeout is long. kombu scans for overdue messages about every 100 s (every 10th call of
    a 10 s timer); a short timeout gets a scan cadence to match, so it means what it says."""
    timeout = settings.redis_visibility_timeout_seconds
    options: dict[str, float] = {"visibility_timeout": timeout}
    if timeout < 120:
        options.update(unacked_restore_interval=max(1.0, timeout / 2), unacked_restore_throttle=1)
    return options


def make_celery(settings: Settings) -> Celery:
    app = Celery("tuneq", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        result_backend=None,
        task_default_queue=settings.queue,
        task_serializer="json",
        accept_content=["json"],
        # A worker takes one job at a time and reserves nothing beyond it: a prefetched job
        # would wait hours behind the running one while another GPU host sits idle.
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        # Ack after the task returns, so a worker lost before it claims the job leaves the
        # message for another; a redelivery of a claimed job is a no-op (claim_job).
        task_acks_late=True,
        task_reject_on_worker_lost=False,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=3,
        # Hours-long tasks: Redis must not redeliver while the task still runs.
        broker_transport_options=redis_transport_options(settings)
        if settings.broker_url.startswith(("redis://", "rediss://"))
        else {},
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app


@lru_cache
def get_celery() -> Celery:
    return make_celery(get_settings())


# Publishing must not hold a submit for long when the broker is down: the job row is already
# committed and the reconciler publishes it once the broker is back.
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}


def size_queue(settings: Settings, device_count: int) -> str:
    """The queue the workers with ``device_count`` devices consume: ``tuneq-8dev`` for a host
    of 8 GPUs, ``tuneq-2dev`` for a CPU worker of 2 cores (CPU workers count cores as devices).

    One queue per worker size lets a deployment mix hosts: a job goes to the smallest size
    that fits it (shared.db.lifecycle.route_job), so an 8-GPU host is not taken by 1-GPU jobs
    while 1-GPU hosts sit idle.

    Until 2026-12 the name said ``gpu`` (``tuneq-8gpu``, on CPU hosts too). A job queued under
    such a name when a deployment upgrades has no live worker consuming its queue: the workers'
    reconcilers publish it again to its size's queue of now (shared.db.lifecycle.unpublished_jobs),
    TUNEQ_REPUBLISH_AFTER_SECONDS after it was published.
    """
    return f"{settings.queue}-{device_count}dev"


def node_queue(settings: Settings, worker_id: str) -> str:
    """The queue only the worker ``worker_id`` consumes: the nodes of multi-node jobs placed on
    it (``tuneq-node-host-123``)."""
    return f"{settings.queue}-node-{worker_id.replace(':', '-')}"


def enqueue_job(job_id: uuid.UUID, *, queue: str) -> None:
    get_celery().send_task(RUN_JOB_TASK, args=[str(job_id)], queue=queue, retry=True, retry_policy=PUBLISH_RETRY)


def enqueue_node(job_id: uuid.UUID, *, attempt: int, node_rank: int, queue: str) -> None:
    get_celery().send_task(
        RUN_NODE_TASK, args=[str(job_id), attempt, node_rank], queue=queue, retry=True, retry_policy=PUBLISH_RETRY
    )


def declare_embedded_queue(queue: str, attempts: int = 5) -> None:
    """Create a worker's queue in the embedded SQL broker before any process uses it.

    kombu's SQL transport creates a queue row on first use without guarding against a
    second process doing the same: an API publishing its first job while a worker starts
    consuming can both insert it, and the loser crashes. A worker declares its queue before
    it registers, and the API publishes only to registered workers' queues, so nothing is
    left to race over but two workers of one size starting together: that race is retried.
    Redis needs none of this.
    """
    settings = get_settings()
    if not settings.uses_embedded_broker:
        return
    app = get_celery()
    for attempt in range(1, attempts + 1):
        try:
            with app.connection_for_write() as conn:
                app.amqp.queues[queue].bind(conn.default_channel).declare()
            return
        except Exception as e:  # the other process won the insert: the row exists now
            if attempt == attempts:
                raise
            logger.info("declaring the broker queue raced another process (%s); again", type(e).__name__)
            time.sleep(0.2 * attempt)


def broker_reachable(timeout: float = 3.0) -> bool:
    try:
        with get_celery().connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
        return True
    except Exception as e:  # any transport error means "not ready"
        logger.warning("broker not reachable: %s", e)
        return False
