"""The job state machine, on SQLite and on Postgres: every transition is conditional."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import update
from sqlmodel import Session, col, select

from shared.db.engine import get_engine
from shared.db.lifecycle import (
    JobFinishedError,
    JobStateError,
    claim_job,
    expired_leases,
    finish_job,
    finish_pause,
    mark_published,
    mark_unpublished,
    prune_workers,
    register_worker,
    release_job,
    renew_lease,
    request_cancel,
    request_pause,
    request_resume,
    route_job,
    set_worker_idle,
    stop_worker,
    unpublished_jobs,
)
from shared.db.models import Job, JobEvent, Worker, utcnow
from shared.jobs.status import JobStatus
from shared.settings import get_settings


def new_job(**fields: object) -> Job:
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config={}, num_gpus=1, training={}, **fields)
        session.add(job)
        session.commit()
        return job


def session() -> Session:
    return Session(get_engine(), expire_on_commit=False)


def statuses(job: Job) -> list[str]:
    with session() as s:
        events = s.exec(select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id))).all()
        return [e.data["status"] for e in events if e.type == "status"]


def test_a_job_is_claimed_once(database_url: str) -> None:
    job = new_job()
    with session() as s:
        first = claim_job(session=s, job_id=job.id, worker_id="w1", lease_ttl=60)
        second = claim_job(session=s, job_id=job.id, worker_id="w2", lease_ttl=60)
    assert first is not None and first.status == JobStatus.running and first.worker_id == "w1"
    assert first.attempts == 1 and first.started_at is not None and first.lease_expires_at is not None
    assert second is None
    assert statuses(job) == ["running"]


def test_finish_only_from_an_active_status(database_url: str) -> None:
    job = new_job()
    with session() as s:
        assert not finish_job(session=s, job_id=job.id, status=JobStatus.succeeded)  # still queued
        claim_job(session=s, job_id=job.id, worker_id="w1", lease_ttl=60)
        assert not finish_job(session=s, job_id=job.id, status=JobStatus.succeeded, attempt=2)  # not this attempt
        assert finish_job(session=s, job_id=job.id, status=JobStatus.failed, error_code="x", error_message="m")
        assert not finish_job(session=s, job_id=job.id, status=JobStatus.succeeded)
        done = s.get(Job, job.id, populate_existing=True)
        # A redelivered message after the job ended does nothing.
        assert claim_job(session=s, job_id=job.id, worker_id="w2", lease_ttl=60) is None
    assert done is not None and done.status == JobStatus.failed and done.error_message == "m"
    assert done.finished_at is not None and done.lease_expires_at is None
    assert statuses(job) == ["running", "failed"]


def test_lease_renewal_belongs_to_the_attempt(database_url: str) -> None:
    job = new_job()
    with session() as s:
        claim_job(session=s, job_id=job.id, worker_id="w1", lease_ttl=60)
        assert renew_lease(session=s, job_id=job.id, worker_id="w1", attempt=1, lease_ttl=60) == JobStatus.running
        assert renew_lease(session=s, job_id=job.id, worker_id="w2", attempt=1, lease_ttl=60) is None
        assert renew_lease(session=s, job_id=job.id, worker_id="w1", attempt=2, lease_ttl=60) is None


def test_cancel(database_url: str) -> None:
    queued, running, done = new_job(), new_job(), new_job()
    with session() as s:
        assert request_cancel(session=s, job_id=queued.id).status == JobStatus.cancelled
        assert request_cancel(session=s, job_id=queued.id).status == JobStatus.cancelled  # again: same answer
        claim_job(session=s, job_id=running.id, worker_id="w", lease_ttl=60)
        assert request_cancel(session=s, job_id=running.id).status == JobStatus.cancelling
        assert renew_lease(session=s, job_id=running.id, worker_id="w", attempt=1, lease_ttl=60) == "cancelling"
        claim_job(session=s, job_id=done.id, worker_id="w", lease_ttl=60)
        finish_job(session=s, job_id=done.id, status=JobStatus.succeeded)
        with pytest.raises(JobFinishedError, match="already succeeded"):
            request_cancel(session=s, job_id=done.id)
    assert statuses(queued) == ["cancelled"]
    assert statuses(running) == ["running", "cancelling"]


def test_lost_jobs_are_requeued_until_max_restarts_then_fail(database_url: str) -> None:
    job = new_job(max_restarts=1)
    outcomes = []
    with session() as s:
        for worker in ("w1", "w2"):
            claim_job(session=s, job_id=job.id, worker_id=worker, lease_ttl=-1)  # expires at once
            lost = expired_leases(session=s, now=utcnow())
            assert [j.id for j in lost] == [job.id]
            outcomes.append(release_job(session=s, job=lost[0], reason="lost"))
            assert release_job(session=s, job=lost[0], reason="lost") is None  # a second reconciler loses
        final = s.get(Job, job.id, populate_existing=True)
    assert outcomes == [JobStatus.queued, JobStatus.failed]
    assert final is not None and final.attempts == 2 and final.error_code == "worker_lost"
    assert statuses(job) == ["running", "queued", "running", "failed"]


def test_a_lost_cancelling_job_is_cancelled_not_restarted(database_url: str) -> None:
    job = new_job()
    with session() as s:
        claim_job(session=s, job_id=job.id, worker_id="w1", lease_ttl=-1)
        request_cancel(session=s, job_id=job.id)
        (lost,) = expired_leases(session=s, now=utcnow())
        assert release_job(session=s, job=lost, reason="lost") == JobStatus.cancelled


def test_pause_a_running_job_through_pausing_and_resume_it(database_url: str) -> None:
    job = new_job()
    with session() as s:
        claim_job(session=s, job_id=job.id, worker_id="w", lease_ttl=60)
        assert request_pause(session=s, job_id=job.id).status == JobStatus.pausing
        assert request_pause(session=s, job_id=job.id).status == JobStatus.pausing  # again: same answer
        # The worker still holds the attempt while its ranks checkpoint: the lease renews.
        assert renew_lease(session=s, job_id=job.id, worker_id="w", attempt=1, lease_ttl=60) == "pausing"
        with pytest.raises(JobStateError, match="is pausing; only a paused job can be resumed"):
            request_resume(session=s, job_id=job.id)
        assert not finish_pause(session=s, job_id=job.id, attempt=2, step=7)  # not this attempt
        assert finish_pause(session=s, job_id=job.id, attempt=1, step=7, checkpoint="step-00000007")
        assert not finish_pause(session=s, job_id=job.id, attempt=1, step=7)  # once
        paused = s.get(Job, job.id, populate_existing=True)
        assert paused is not None and paused.status == JobStatus.paused
        # No worker, no lease: nothing renews, expires or claims it, and it is not finished.
        assert (paused.worker_id, paused.lease_expires_at, paused.finished_at, paused.pauses) == (None, None, None, 1)
        assert renew_lease(session=s, job_id=job.id, worker_id="w", attempt=1, lease_ttl=60) is None
        assert expired_leases(session=s, now=utcnow() + timedelta(days=1)) == []
        assert claim_job(session=s, job_id=job.id, worker_id="w", lease_ttl=60) is None
        assert request_pause(session=s, job_id=job.id).status == JobStatus.paused  # idempotent
        resumed = request_resume(session=s, job_id=job.id)
        assert (resumed.status, resumed.enqueued_at, resumed.attempts) == (JobStatus.queued, None, 1)
        with pytest.raises(JobStateError, match="is queued; only a paused job can be resumed"):
            request_resume(session=s, job_id=job.id)
        assert claim_job(session=s, job_id=job.id, worker_id="w2", lease_ttl=60) is not None  # the next attempt
    assert statuses(job) == ["running", "pausing", "paused", "queued", "running"]
    with session() as s:
        events = s.exec(select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id))).all()
    paused_event = next(e.data for e in events if e.data.get("status") == "paused")
    assert paused_event == {"status": "paused", "step": 7, "attempt": 1, "checkpoint": "step-00000007"}


def test_a_queued_job_pauses_at_once_and_a_paused_one_cancels_at_once(database_url: str) -> None:
    job = new_job()
    with session() as s:
        mark_published(session=s, job_id=job.id, queue="q-1gpu")
        paused = request_pause(session=s, job_id=job.id)
        assert (paused.status, paused.enqueued_at) == (JobStatus.paused, None)
        # Its message, still in the broker, claims nothing; no reconciler publishes it again.
        assert claim_job(session=s, job_id=job.id, worker_id="w", lease_ttl=60) is None
        assert unpublished_jobs(session=s, older_than=utcnow(), live_since=utcnow()) == []
        cancelled = request_cancel(session=s, job_id=job.id)
        assert (cancelled.status, cancelled.error_message) == (JobStatus.cancelled, "cancelled while paused")
        with pytest.raises(JobFinishedError, match="already cancelled; only queued or running jobs can be paused"):
            request_pause(session=s, job_id=job.id)
        with pytest.raises(JobFinishedError, match="already cancelled; only a paused job can be resumed"):
            request_resume(session=s, job_id=job.id)
    assert statuses(job) == ["paused", "cancelled"]


def test_pause_is_refused_once_a_job_ended_or_while_it_is_cancelled(database_url: str) -> None:
    done, cancelling, pausing = new_job(), new_job(), new_job()
    with session() as s:
        for job in (done, cancelling, pausing):
            claim_job(session=s, job_id=job.id, worker_id="w", lease_ttl=60)
        finish_job(session=s, job_id=done.id, status=JobStatus.succeeded)
        with pytest.raises(JobFinishedError, match="already succeeded"):
            request_pause(session=s, job_id=done.id)
        request_cancel(session=s, job_id=cancelling.id)
        with pytest.raises(JobStateError, match="is being cancelled"):
            request_pause(session=s, job_id=cancelling.id)
        # A cancel wins over a pause under way: the worker stops the ranks as for any cancel.
        request_pause(session=s, job_id=pausing.id)
        assert request_cancel(session=s, job_id=pausing.id).status == JobStatus.cancelling
        assert not finish_pause(session=s, job_id=pausing.id, attempt=1, step=3)
    assert statuses(pausing) == ["running", "pausing", "cancelling"]


def test_a_pause_is_not_a_restart_and_a_lost_pausing_job_is_paused(database_url: str) -> None:
    job, lost_while_pausing = new_job(max_restarts=1), new_job()
    with session() as s:
        # Attempt 1 pauses; attempt 2 is lost: the one restart allowed, so it is requeued.
        claim_job(session=s, job_id=job.id, worker_id="w1", lease_ttl=60)
        request_pause(session=s, job_id=job.id)
        finish_pause(session=s, job_id=job.id, attempt=1, step=4)
        request_resume(session=s, job_id=job.id)
        claim_job(session=s, job_id=job.id, worker_id="w2", lease_ttl=-1)
        (lost,) = expired_leases(session=s, now=utcnow())
        assert release_job(session=s, job=lost, reason="lost") == JobStatus.queued
        # Attempt 3 is lost too: past max_restarts, counting the attempts that were not pauses.
        claim_job(session=s, job_id=job.id, worker_id="w3", lease_ttl=-1)
        (lost,) = expired_leases(session=s, now=utcnow())
        assert release_job(session=s, job=lost, reason="lost") == JobStatus.failed
        failed = s.get(Job, job.id, populate_existing=True)
        assert failed is not None and "gave up after 3 attempts (1 of them paused)" in (failed.error_message or "")

        # A job lost while pausing was to stop anyway: paused, not requeued (a resume continues
        # from its newest checkpoint), and that attempt was a restart, not a pause.
        claim_job(session=s, job_id=lost_while_pausing.id, worker_id="w", lease_ttl=-1)
        request_pause(session=s, job_id=lost_while_pausing.id)
        (lost,) = expired_leases(session=s, now=utcnow())
        assert release_job(session=s, job=lost, reason="lost") == JobStatus.paused
        paused = s.get(Job, lost_while_pausing.id, populate_existing=True)
        assert paused is not None and (paused.attempts, paused.pauses, paused.worker_id) == (1, 0, None)
    assert statuses(job) == ["running", "pausing", "paused", "queued", "running", "queued", "running", "failed"]
    assert statuses(lost_while_pausing) == ["running", "pausing", "paused"]


def test_a_hand_back_by_a_stopping_worker_is_never_a_restart(database_url: str) -> None:
    """Deploys during a long run: each stop hands the job back, requeued whatever its
    max_restarts, and counted in handbacks; a later lost attempt is judged on the others."""
    job = new_job(max_restarts=0)
    with session() as s:
        for worker in ("w1", "w2", "w3"):
            running = claim_job(session=s, job_id=job.id, worker_id=worker, lease_ttl=60)
            assert running is not None
            assert release_job(session=s, job=running, reason="stopped", handed_back=True) == JobStatus.queued
        back = s.get(Job, job.id, populate_existing=True)
        assert back is not None and (back.attempts, back.handbacks, back.worker_id) == (3, 3, None)
        # Attempt 4 is lost: its first restart, past max_restarts 0, counting no hand-back.
        claim_job(session=s, job_id=job.id, worker_id="w4", lease_ttl=-1)
        (lost,) = expired_leases(session=s, now=utcnow())
        assert release_job(session=s, job=lost, reason="lost") == JobStatus.failed
        failed = s.get(Job, job.id, populate_existing=True)
    assert failed is not None
    assert "gave up after 4 attempts (3 of them handed back by a stopping worker)" in (failed.error_message or "")


def test_unpublished_jobs_are_those_an_idle_worker_would_have_taken(database_url: str) -> None:
    never, published = new_job(), new_job()
    soon = utcnow() + timedelta(seconds=1)
    long_ago = utcnow() - timedelta(days=1)
    with session() as s:
        register_worker(session=s, worker_id="w", hostname="h", accelerator="cpu", device_count=1, queue="q-1gpu")
        set_worker_idle(session=s, worker_id="w", idle=False)
        mark_published(session=s, job_id=published.id, queue="q-1gpu")

        def lost(older_than: datetime) -> set[object]:
            return {j.id for j in unpublished_jobs(session=s, older_than=older_than, live_since=long_ago)}

        assert lost(soon) == {never.id}  # the worker is busy: the message is waiting, not lost
        register_worker(session=s, worker_id="w8", hostname="h", accelerator="cpu", device_count=8, queue="q-8gpu")
        assert lost(soon) == {never.id}  # an idle worker of another size would not have taken it
        set_worker_idle(session=s, worker_id="w", idle=True)
        assert lost(soon) == {never.id, published.id}  # its queue's worker idle since before the cutoff, no claim
        assert lost(utcnow() - timedelta(seconds=60)) == {never.id}  # published too recently


def test_a_job_whose_queue_lost_its_workers_is_published_again(database_url: str) -> None:
    job = new_job()
    with session() as s:
        register_worker(session=s, worker_id="w", hostname="h", accelerator="cpu", device_count=1, queue="q-1gpu")
        set_worker_idle(session=s, worker_id="w", idle=False)
        mark_published(session=s, job_id=job.id, queue="q-1gpu")
        soon = utcnow() + timedelta(seconds=1)
        assert unpublished_jobs(session=s, older_than=soon, live_since=utcnow() - timedelta(days=1)) == []
        # The 1-GPU worker is no longer seen: the message waits in a queue nobody consumes.
        later = utcnow() + timedelta(seconds=5)
        assert [j.id for j in unpublished_jobs(session=s, older_than=later, live_since=later)] == [job.id]


def test_a_stopped_worker_does_not_make_its_queues_waiting_jobs_look_lost(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The republish storm: one worker of a queue stopped while another was busy with it. The
    stopped one still looked live and idle, so every waiting job of the queue looked lost."""
    monkeypatch.setenv("TUNEQ_QUEUE", "tq")
    get_settings.cache_clear()
    settings = get_settings()
    waiting = new_job()
    with session() as s:
        for worker_id in ("stopping", "busy"):
            register_worker(
                session=s, worker_id=worker_id, hostname="h", accelerator="cpu", device_count=1, queue="tq-1dev"
            )
        set_worker_idle(session=s, worker_id="busy", idle=False)
        mark_published(session=s, job_id=waiting.id, queue="tq-1dev")
        soon, long_ago = utcnow() + timedelta(seconds=1), utcnow() - timedelta(days=1)
        stop_worker(session=s, worker_id="stopping")
        assert unpublished_jobs(session=s, older_than=soon, live_since=long_ago) == []  # it waits for "busy"
        # Nor is a stopped worker's size routed to, or counted by the API's hardware checks.
        stop_worker(session=s, worker_id="busy")
        assert route_job(session=s, settings=settings, num_gpus=1) is None
        assert [j.id for j in unpublished_jobs(session=s, older_than=soon, live_since=long_ago)] == [waiting.id]
        # A stopped worker that starts again is live again.
        register_worker(session=s, worker_id="busy", hostname="h", accelerator="cpu", device_count=1, queue="tq-1dev")
        assert route_job(session=s, settings=settings, num_gpus=1) == "tq-1dev"


def test_workers_not_seen_for_long_are_forgotten(database_url: str) -> None:
    with session() as s:
        for worker_id in ("old", "recent"):
            register_worker(session=s, worker_id=worker_id, hostname="h", accelerator="cpu", device_count=1, queue="q")
        s.execute(update(Worker).where(col(Worker.id) == "old").values(last_seen_at=utcnow() - timedelta(days=2)))
        s.commit()
        assert prune_workers(session=s, before=utcnow() - timedelta(days=1)) == 1
        assert [w.id for w in s.exec(select(Worker)).all()] == ["recent"]


def test_a_job_goes_to_the_smallest_live_worker_size_that_fits(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNEQ_QUEUE", "tq")
    get_settings.cache_clear()
    settings = get_settings()
    with session() as s:
        assert route_job(session=s, settings=settings, num_gpus=1) is None  # no worker yet: wait for one
        for worker_id, n in (("w2", 2), ("w8", 8)):
            register_worker(
                session=s, worker_id=worker_id, hostname="h", accelerator="cuda", device_count=n, queue=f"tq-{n}dev"
            )
        assert route_job(session=s, settings=settings, num_gpus=1) == "tq-2dev"
        assert route_job(session=s, settings=settings, num_gpus=2) == "tq-2dev"
        assert route_job(session=s, settings=settings, num_gpus=3) == "tq-8dev"
        assert route_job(session=s, settings=settings, num_gpus=9) is None
        s.execute(update(Worker).where(col(Worker.id) == "w2").values(last_seen_at=utcnow() - timedelta(days=1)))
        s.commit()
        assert route_job(session=s, settings=settings, num_gpus=1) == "tq-8dev"  # the 2-GPU host is gone


def test_a_dropped_delivery_is_published_again(database_url: str) -> None:
    job = new_job()
    with session() as s:
        mark_published(session=s, job_id=job.id, queue="q-1gpu")
        assert unpublished_jobs(session=s, older_than=utcnow() - timedelta(days=1), live_since=utcnow()) == []
        mark_unpublished(session=s, job_id=job.id)
        assert [j.id for j in unpublished_jobs(session=s, older_than=utcnow(), live_since=utcnow())] == [job.id]
