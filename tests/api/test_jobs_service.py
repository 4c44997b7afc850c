"""api.jobs_service: what the job routes do, called directly."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import Connection, event
from sqlmodel import Session

from api import jobs_service
from cli.samples import seed_config
from shared.db.engine import get_engine, get_read_engine
from shared.db.lifecycle import register_worker
from shared.db.models import Job, Worker
from shared.jobs.spec import JobCreate
from shared.queue import size_queue
from shared.settings import Settings, get_settings


def add_job(session: Session, name: str) -> uuid.UUID:
    job = Job(
        name=name, model="/m", dataset="/d.jsonl", deepspeed_config={"train_batch_size": 1}, num_gpus=1, training={}
    )
    session.add(job)
    session.commit()
    return job.id


def test_the_answers_of_many_jobs_are_read_in_one_query(database_url: str) -> None:
    # api.read_cache's batched read: the jobs that miss together cost one SELECT, not one each.
    with Session(get_engine()) as session:
        jobs = [add_job(session, f"job-{n}") for n in range(3)]
    missing = uuid.uuid4()
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", record)
    try:
        with Session(get_read_engine()) as session:
            answers = jobs_service.job_answers(session=session, job_ids=[*jobs, missing])
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert [s for s in statements if "FROM jobs" in s and s.lstrip().upper().startswith("SELECT")] == statements
    assert len(statements) == 1
    assert set(answers) == set(jobs)  # a job that does not exist is left out
    for job_id in jobs:
        body = json.loads(answers[job_id].body)
        assert body["id"] == str(job_id) and answers[job_id].owner == body["owner"] == "local"
    with Session(get_engine()) as session:
        job = session.get(Job, jobs[0])
        assert job is not None
        assert answers[jobs[0]].body == jobs_service.job_public(session=session, job=job).model_dump_json().encode()


def _add_live_workers(settings: Settings) -> None:
    """CPU workers of 2 and 8 devices, each consuming its size's queue, and a live row of 1
    device from before workers had queues (counted as hardware, never routed to)."""
    with Session(get_engine()) as session:
        for worker_id, devices in (("w8", 8), ("w2", 2)):
            register_worker(
                session=session,
                worker_id=worker_id,
                hostname="h",
                accelerator="cpu",
                device_count=devices,
                queue=size_queue(settings, devices),
            )
        session.add(Worker(id="old", hostname="h", accelerator="cpu", device_count=1))
        session.commit()


def test_a_submit_goes_to_the_queue_of_the_smallest_live_worker_that_fits(
    database_url: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = get_settings()
    _add_live_workers(settings)
    published: list[tuple[uuid.UUID, str]] = []
    monkeypatch.setattr(jobs_service, "enqueue_job", lambda job_id, *, queue: published.append((job_id, queue)))
    for num_gpus, queue in ((1, size_queue(settings, 2)), (3, size_queue(settings, 8))):
        with Session(get_engine(), expire_on_commit=False) as session:
            config = seed_config(fp16=False, train_batch_size=num_gpus)
            job_in = JobCreate.model_validate({**body, "num_gpus": num_gpus, "deepspeed_config": config})
            job, created = jobs_service.create_job(session=session, job_in=job_in, settings=settings, owner="local")
        assert created and published[-1] == (job.id, queue)
        with Session(get_engine()) as session:
            stored = session.get(Job, job.id)
            assert stored is not None and stored.queue == queue and stored.enqueued_at is not None
            # The answer the submit gives is what a read of the job gives.
            assert jobs_service.job_public(session=session, job=stored) == jobs_service.job_public(
                session=session, job=job
            )


@pytest.mark.parametrize("empty_database_url", ["postgres"], indirect=True)
def test_a_submit_takes_one_transaction_and_seven_statements(
    empty_database_url: str, database_url: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each round trip to the database costs the API's CPU (BENCHMARKS.md, B9): the idempotency
    # look-up, the owner's lock, the count, the workers, the two INSERTs (and the COMMIT), then
    # after the publish the UPDATE that records it, in autocommit. The workers are read once,
    # for the checks and the route; nothing is read back.
    settings = get_settings()
    _add_live_workers(settings)
    monkeypatch.setattr(jobs_service, "enqueue_job", lambda job_id, *, queue: None)
    statements: list[str] = []
    commits: list[bool] = []  # whether each COMMIT ended a transaction the server saw (not autocommit)

    def statement(conn: Connection, _cursor: Any, text: str, *_args: Any) -> None:
        statements.append(text)

    def commit(conn: Connection) -> None:
        commits.append(not conn.connection.dbapi_connection.autocommit)  # type: ignore[union-attr]

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "commit", commit)
    try:
        with Session(engine, expire_on_commit=False) as session:
            job_in = JobCreate.model_validate(body)
            jobs_service.create_job(
                session=session, job_in=job_in, settings=settings, owner="local", idempotency_key="once"
            )
    finally:
        event.remove(engine, "before_cursor_execute", statement)
        event.remove(engine, "commit", commit)
    assert len(statements) <= 7, "\n".join(statements)
    assert commits.count(True) == 1
