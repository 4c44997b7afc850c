"""GET /metrics: Prometheus text read from the database at scrape time, and API latency."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlmodel import Session

from cli.samples import seed_config
from shared.db.engine import get_engine
from shared.db.models import Job, JobMetric, Worker, utcnow
from shared.jobs.status import JobStatus


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:
        yield c


def samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def add_job(session: Session, status: JobStatus, num_nodes: int = 1) -> Job:
    job = Job(
        model="m",
        dataset="d",
        deepspeed_config=seed_config(fp16=False),
        num_gpus=1,
        num_nodes=num_nodes,
        training={},
        status=status,
    )
    session.add(job)
    return job


def test_jobs_by_status_queue_depth_workers_and_pace(client: TestClient) -> None:
    now = utcnow()
    with Session(get_engine()) as session:
        for status in (JobStatus.queued, JobStatus.queued, JobStatus.succeeded):
            add_job(session, status)
        add_job(session, JobStatus.queued).queue = "tuneq-2gpu"
        running = add_job(session, JobStatus.running)
        stalled = add_job(session, JobStatus.running)  # one step recorded: no pace yet
        session.flush()
        # 10 steps over 5 s: 2 steps per second, whatever order the rows were written in.
        for step in (10, 1, 5):
            session.add(JobMetric(job_id=running.id, step=step, time=now - timedelta(seconds=(10 - step) / 2)))
        session.add(JobMetric(job_id=stalled.id, step=1, time=now))
        session.add(Worker(id="w1", hostname="h", accelerator="cpu", device_count=1, last_seen_at=now))
        session.add(
            Worker(id="w2", hostname="h", accelerator="cpu", device_count=1, last_seen_at=now - timedelta(days=1))
        )
        session.commit()
        running_id, stalled_id = running.id, stalled.id

    got = samples(client)
    assert got[("tuneq_database_up", ())] == 1
    assert got[("tuneq_jobs", (("status", "queued"),))] == 3
    assert got[("tuneq_jobs", (("status", "running"),))] == 2
    assert got[("tuneq_jobs", (("status", "succeeded"),))] == 1
    assert got[("tuneq_jobs", (("status", "failed"),))] == 0
    assert got[("tuneq_queue_depth", (("queue", ""),))] == 2  # not published yet
    assert got[("tuneq_queue_depth", (("queue", "tuneq-2gpu"),))] == 1
    assert got[("tuneq_workers", ())] == 1
    assert got[("tuneq_job_steps_per_second", (("job_id", str(running_id)),))] == pytest.approx(2.0, rel=1e-3)
    assert ("tuneq_job_steps_per_second", (("job_id", str(stalled_id)),)) not in got
    assert got[("tuneq_gangs_waiting", ())] == 0  # no multi-node job: the gauge is there, at 0


def test_gangs_waiting_counts_queued_multi_node_jobs_only(client: TestClient) -> None:
    with Session(get_engine()) as session:
        add_job(session, JobStatus.queued, num_nodes=2)
        add_job(session, JobStatus.queued, num_nodes=4)
        add_job(session, JobStatus.queued)  # one node: published to a size queue, not a gang
        add_job(session, JobStatus.running, num_nodes=2)  # placed
        add_job(session, JobStatus.cancelled, num_nodes=2)
        session.commit()

    got = samples(client)
    assert got[("tuneq_gangs_waiting", ())] == 2
    # A gang is never published: it waits in the unpublished queue with the one-node job.
    assert got[("tuneq_queue_depth", (("queue", ""),))] == 3


def test_request_latency_by_route_template_not_raw_path(client: TestClient) -> None:
    for _ in range(3):
        assert client.get(f"/jobs/{uuid.uuid4()}").status_code == 404
    assert client.get("/healthz").status_code == 200
    got = samples(client)
    by_job = (("method", "GET"), ("route", "/jobs/{job_id}"), ("status", "404"))
    assert got[("tuneq_http_request_duration_seconds_count", by_job)] == 3
    assert (
        got[
            ("tuneq_http_request_duration_seconds_count", (("method", "GET"), ("route", "/healthz"), ("status", "200")))
        ]
        == 1
    )
    assert not any(
        "route" in dict(labels) and dict(labels)["route"].startswith("/jobs/") and "{" not in dict(labels)["route"]
        for _, labels in got
    )


def test_a_database_outage_is_reported_not_raised(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    import api.metrics

    def unreachable() -> None:
        raise ConnectionError("database down")

    monkeypatch.setattr(api.metrics, "get_engine", unreachable)
    got = samples(client)
    assert got[("tuneq_database_up", ())] == 0
    assert not any(name == "tuneq_jobs" for name, _ in got)
