"""The reconciler's decisions on lost work, on SQLite and on Postgres."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlmodel import col, select

from shared.db.lifecycle import mark_published, register_worker
from shared.db.models import Job, JobEvent, JobNode, utcnow
from shared.jobs.status import JobStatus
from shared.queue import size_queue
from shared.settings import get_settings
from tests.shared.db.test_gangs import new_job, session, start_placed_gang, workers
from worker import reconciler
from worker.reconciler import reconcile_once


def test_a_gang_whose_node_1_died_is_released_naming_node_1_though_node_0s_job_lease_expired_too(
    database_url: str,
) -> None:
    """Node 0's worker, its ranks gone with their peer, may stop renewing the job's lease
    before the reconciler sees node 1's expired: the lost node is the cause the job reports."""
    workers("w1", "w2")
    job = new_job(num_nodes=2, max_restarts=0)  # fails on this release: nothing is placed again
    nodes = start_placed_gang(job)
    with session() as s:
        past = utcnow() - timedelta(seconds=1)
        s.execute(update(Job).where(col(Job.id) == job.id).values(lease_expires_at=past))
        s.execute(
            update(JobNode)
            .where(col(JobNode.job_id) == job.id, col(JobNode.node_rank) == 1)
            .values(lease_expires_at=past)
        )
        s.commit()
    reconcile_once(settings=get_settings())
    with session() as s:
        found = s.get(Job, job.id)
        assert found is not None and found.status == JobStatus.failed
        assert found.error_message is not None
        assert found.error_message.startswith(f"node 1 (worker {nodes[1].worker_id}) stopped renewing its lease")
        events = s.exec(select(JobEvent).where(col(JobEvent.job_id) == job.id)).all()
    messages = [str(e.data.get("message", "")) for e in events]
    assert not any("node 0" in m for m in messages), messages


def test_a_job_queued_under_a_queue_name_of_before_an_upgrade_is_published_again_to_its_size_queue(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Size queues were named `tuneq-<n>gpu`, CPU hosts included, and are `tuneq-<n>dev`: a job
    still queued under its old name when the workers are upgraded has no live worker consuming
    it, and the reconciler publishes it again to the queue of its size of now."""
    published: list[tuple[str, str]] = []
    monkeypatch.setattr(reconciler, "enqueue_job", lambda job_id, *, queue: published.append((str(job_id), queue)))
    settings = get_settings()
    job = new_job(num_nodes=1)
    with session() as s:
        mark_published(session=s, job_id=job.id, queue=f"{settings.queue}-2gpu")  # by the version before
        register_worker(
            session=s,
            worker_id="upgraded",
            hostname="h",
            accelerator="cpu",
            device_count=2,
            queue=size_queue(settings, 2),
        )
    assert size_queue(settings, 2) == f"{settings.queue}-2dev"
    reconcile_once(settings=settings.model_copy(update={"republish_after_seconds": 0}))
    assert published == [(str(job.id), f"{settings.queue}-2dev")]
    with session() as s:
        found = s.get(Job, job.id)
        assert found is not None and found.queue == f"{settings.queue}-2dev" and found.status == JobStatus.queued
