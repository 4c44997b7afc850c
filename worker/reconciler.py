"""The database decides who runs a job, not the broker: find lost jobs and lost messages.

Every worker runs this loop (any number may: each action is a conditional UPDATE that only
one reconciler can win). It requeues running jobs whose lease expired (their worker died),
and publishes again queued jobs that nobody claimed (a broker that was down at submit, or a
message lost with a killed worker). On its own host it also removes the shared-memory
buffers that the ranks of a killed worker left once those ranks are gone.

For multi-node jobs it releases a gang one of whose nodes was lost (its lease, or its start
deadline, passed) and places the gangs that can start (shared.db.gangs).
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from shared.db.engine import session_scope
from shared.db.gangs import lost_nodes, place_gangs, publish_node_starts, release_attempt, release_gang
from shared.db.lifecycle import (
    expired_leases,
    mark_published,
    prune_workers,
    route_job,
    unpublished_jobs,
)
from shared.db.models import utcnow
from shared.jobs.status import JobStatus
from shared.queue import enqueue_job
from shared.settings import Settings
from worker.shm_buffers import remove_stale_buffers

logger = logging.getLogger(__name__)

# A worker not seen for this long (stopped, or its host is gone) is forgotten: its row says
# nothing any more, and `workers` would otherwise grow with every worker restart.
FORGET_WORKERS_AFTER = timedelta(days=1)


def reconcile_once(*, settings: Settings) -> None:
    now = utcnow()
    with session_scope() as session:
        for job, node in lost_nodes(session=session, now=now):
            started = node.started_at is not None
            reason = (
                f"node {node.node_rank} (worker {node.worker_id}) "
                + (
                    "stopped renewing its lease"
                    if started
                    else f"did not start within {settings.gang_start_seconds:.0f}s"
                )
                + ": the job's nodes are stopped and it goes back to the queue"
            )
            outcome = release_gang(session=session, job=job, reason=reason, failed_node=node.node_rank)
            if outcome is not None:
                logger.warning("job %s attempt %d: %s -> %s", job.id, job.attempts, reason, outcome.value)
        # After the gangs' nodes: a lost node names itself, which the job's lease (node 0's) cannot.
        for job in expired_leases(session=session, now=now):
            holder = f"the worker running this job ({job.worker_id})"
            if job.num_nodes > 1:
                holder = f"node 0 (worker {job.worker_id})"
            reason = f"{holder} stopped renewing its lease"
            outcome = release_attempt(session=session, job=job, reason=reason, failed_node=0)
            if outcome is not None:
                logger.warning("job %s: lease expired on attempt %d -> %s", job.id, job.attempts, outcome.value)
        starts = place_gangs(session=session, settings=settings)
        publish_node_starts(starts)
        if prune_workers(session=session, before=now - FORGET_WORKERS_AFTER):
            logger.info("forgot workers not seen for %s", FORGET_WORKERS_AFTER)
        cutoff = now - timedelta(seconds=settings.republish_after_seconds)
        live_since = now - timedelta(seconds=settings.worker_seen_seconds)
        for job in unpublished_jobs(session=session, older_than=cutoff, live_since=live_since):
            if job.status != JobStatus.queued:
                continue
            queue = route_job(session=session, settings=settings, num_gpus=job.num_gpus)
            if queue is None:  # no live worker is large enough (any more): wait for one
                logger.debug("job %s: no live worker has %d devices; it stays queued", job.id, job.num_gpus)
                continue
            try:
                enqueue_job(job.id, queue=queue)
            except Exception as e:
                logger.warning("cannot publish queued jobs yet (broker: %s); will retry", e)
                return
            mark_published(session=session, job_id=job.id, queue=queue)
            logger.info("job %s published%s to %s", job.id, " again" if job.enqueued_at else "", queue)


def run_reconciler(*, settings: Settings, stop: threading.Event) -> None:
    while True:
        try:
            reconcile_once(settings=settings)
        except Exception:
            logger.exception("reconciler pass failed; trying again in %.0fs", settings.reconcile_seconds)
        # The ranks of a worker killed just before this one started may still have been dying
        # when it swept at start-up (prepare_worker): their buffers are collected here.
        try:
            remove_stale_buffers()
        except OSError:
            logger.exception("cannot sweep stale all-reduce buffers; trying again in %.0fs", settings.reconcile_seconds)
        if stop.wait(settings.reconcile_seconds):
            return
