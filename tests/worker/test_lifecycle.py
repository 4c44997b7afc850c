from __future__ import annotations

from sqlmodel import Session

from shared.db import get_engine
from shared.models import Job, JobStatus
from worker.lifecycle import claim_job, finish_job


def new_job() -> Job:
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config={}, num_gpus=1, training={})
        session.add(job)
        session.commit()
        return job


def test_a_job_is_claimed_once(database_url: str) -> None:
    job = new_job()
    with Session(get_engine(), expire_on_commit=False) as session:
        first = claim_job(session=session, job_id=job.id, worker_id="w1")
        second = claim_job(session=session, job_id=job.id, worker_id="w2")
    assert first is not None and first.status == JobStatus.running and first.worker_id == "w1"
    assert first.attempts == 1 and first.started_at is not None
    assert second is None


def test_finish_only_from_running(database_url: str) -> None:
    job = new_job()
    with Session(get_engine()) as session:
        assert not finish_job(session=session, job_id=job.id, status=JobStatus.succeeded)  # still queued
        claim_job(session=session, job_id=job.id, worker_id="w1")
        assert finish_job(session=session, job_id=job.id, status=JobStatus.failed, error_code="x", error_message="m")
        assert not finish_job(session=session, job_id=job.id, status=JobStatus.succeeded)
        done = session.get(Job, job.id, populate_existing=True)
    assert done is not None and done.status == JobStatus.failed and done.error_message == "m"
    assert done.finished_at is not None
    # A redelivered message after the job ended does nothing.
    with Session(get_engine()) as session:
        assert claim_job(session=session, job_id=job.id, worker_id="w2") is None
