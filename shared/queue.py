"""The Celery app both sides share: the API publishes job ids, workers consume them.

Settings fit hours-long tasks on exclusive GPUs (see ARCHITECTURE.md, "Why these Celery
settings"): one job per worker process, no prefetching, late acks, and the database, not the
broker, decides whether a delivered job runs.
"""

from __future__ import annotations

import logging
import uuid
from functools import lru_cache

from celery import Celery

from shared.settings import Settings, get_settings

logger = logging.getLogger(__name__)

RUN_JOB_TASK = "tuneq.run_job"


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
        # Hours-long tasks: Redis must not redeliver while the task still runs.
        broker_transport_options={"visibility_timeout": 7 * 24 * 3600}
        if settings.broker_url.startswith(("redis://", "rediss://"))
        else {},
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app


@lru_cache
def get_celery() -> Celery:
    return make_celery(get_settings())


def enqueue_job(job_id: uuid.UUID) -> None:
    get_celery().send_task(RUN_JOB_TASK, args=[str(job_id)], queue=get_settings().queue)


def broker_reachable(timeout: float = 3.0) -> bool:
    try:
        with get_celery().connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
        return True
    except Exception as e:  # any transport error means "not ready"
        logger.warning("broker not reachable: %s", e)
        return False
