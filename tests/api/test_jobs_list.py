"""GET /jobs: server-side filters, sorting and pages, for the dashboard's jobs list and any client."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session

from cli.samples import seed_config
from shared.db.engine import get_engine
from shared.db.models import Job
from shared.jobs.status import JobStatus

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:
        yield c


def add_jobs(*rows: dict[str, Any]) -> list[str]:
    """Jobs written straight to the table (as many as a test needs, without a worker)."""
    jobs = [
        Job(
            model=row.get("model", "/models/gpt"),
            dataset="/data/train.jsonl",
            deepspeed_config=seed_config(fp16=False),
            num_gpus=1,
            training={},
            **{k: v for k, v in row.items() if k != "model"},
        )
        for row in rows
    ]
    with Session(get_engine(), expire_on_commit=False) as session:
        session.add_all(jobs)
        session.commit()
    return [str(job.id) for job in jobs]


def ids(client: TestClient, **params: Any) -> list[str]:
    response = client.get("/jobs", params=params)
    assert response.status_code == 200, response.text
    return [job["id"] for job in response.json()["data"]]


def count(client: TestClient, **params: Any) -> int:
    answer: int = client.get("/jobs", params=params).json()["count"]
    return answer


def test_filters_combine_and_count_what_they_match(client: TestClient) -> None:
    llama, gpt, failed, old, other = add_jobs(
        {"name": "Llama sweep lr=1e-4", "model": "/models/Llama-3-8B", "created_at": NOW},
        {"name": "gpt baseline", "model": "/models/gpt2", "created_at": NOW - timedelta(hours=1)},
        {"name": "llama retry", "model": "/models/llama-3-8b", "status": JobStatus.failed, "created_at": NOW},
        {"name": "llama old", "model": "/models/llama-3-8b", "created_at": NOW - timedelta(days=30)},
        {"name": "llama of another owner", "model": "/models/llama-3-8b", "owner": "erin", "created_at": NOW},
    )
    assert set(ids(client, model="LLAMA")) == {llama, failed, old}  # a part of the model, any case
    assert count(client, model="LLAMA") == 3
    assert set(ids(client, name="llama")) == {llama, failed, old}
    assert ids(client, name="llama", status="failed") == [failed]
    assert set(ids(client, created_after=(NOW - timedelta(days=1)).isoformat())) == {llama, gpt, failed}
    # A time without an offset is UTC.
    assert set(ids(client, created_after="2026-12-01T11:30:00")) == {llama, failed}
    assert ids(client, model="llama", name="sweep", created_after="2026-12-01T11:30:00Z") == [llama]
    assert count(client, model="mistral") == 0 and ids(client, model="mistral") == []
    assert other not in ids(client, limit=500)  # never another owner's


def test_search_characters_are_literal(client: TestClient) -> None:
    percent, plain = add_jobs({"name": "lr 100%"}, {"name": "lr 1000"})
    assert ids(client, name="100%") == [percent]
    assert ids(client, name="_") == []
    assert set(ids(client, name="lr 1")) == {percent, plain}


def test_sorting_and_pages_cover_every_job_once(client: TestClient) -> None:
    # Equal names and equal times: ties are broken the same way on every page.
    made = add_jobs(*({"name": f"run-{i % 3}", "created_at": NOW - timedelta(minutes=i // 2)} for i in range(9)))
    for sort in ("created_at", "-created_at", "name", "-name", "status", "-status"):
        pages = [ids(client, sort=sort, skip=skip, limit=2) for skip in range(0, 10, 2)]
        listed = [job for page in pages for job in page]
        assert sorted(listed) == sorted(made), sort
    names = [j["name"] for j in client.get("/jobs", params={"sort": "name", "limit": 9}).json()["data"]]
    assert names == sorted(names)
    assert [j["name"] for j in client.get("/jobs", params={"sort": "-name", "limit": 9}).json()["data"]] == names[::-1]
    oldest_first = client.get("/jobs", params={"sort": "created_at", "limit": 9}).json()["data"]
    times = [j["created_at"] for j in oldest_first]
    assert times == sorted(times)


def test_a_part_of_filters_count_stops_at_the_cap_and_says_so(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model or name part-of match reads each matching row to count it: past the cap the
    count says "this many or more"; the pages go on. Other filters count exactly."""
    import api.jobs_service

    monkeypatch.setattr(api.jobs_service, "PART_OF_COUNT_CAP", 3)
    made = add_jobs(*({"name": f"sweep-{i}", "created_at": NOW - timedelta(minutes=i)} for i in range(5)))
    capped = client.get("/jobs", params={"name": "sweep", "limit": 2}).json()
    assert (capped["count"], capped["count_capped"]) == (3, True)
    pages = [ids(client, name="sweep", skip=skip, limit=2) for skip in (0, 2, 4)]
    assert [job for page in pages for job in page] == made  # newest first, every match
    exact = client.get("/jobs", params={"name": "sweep-1"}).json()
    assert (exact["count"], exact["count_capped"]) == (1, False)
    unfiltered = client.get("/jobs").json()
    assert (unfiltered["count"], unfiltered["count_capped"]) == (5, False)


def test_the_default_answer_keeps_its_shape(client: TestClient) -> None:
    older, newer = add_jobs({"created_at": NOW - timedelta(minutes=1)}, {"created_at": NOW})
    answer = client.get("/jobs").json()
    assert set(answer) == {"data", "count", "count_capped"} and answer["count"] == 2 and not answer["count_capped"]
    assert [job["id"] for job in answer["data"]] == [newer, older]  # newest first


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"sort": "step"}, "sort"),
        ({"sort": "created_at;drop"}, "sort"),
        ({"created_after": "yesterday"}, "created_after"),
        ({"name": "x" * 201}, "name"),
    ],
)
def test_a_bad_parameter_is_a_422_naming_it(client: TestClient, params: dict[str, str], field: str) -> None:
    response = client.get("/jobs", params=params)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["query", field]
