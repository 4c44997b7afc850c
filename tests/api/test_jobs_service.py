"""api.jobs_service: what the job routes do, called directly."""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import event
from sqlmodel import Session

from api import jobs_service
from shared.db.engine import get_engine, get_read_engine
from shared.db.models import Job


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
