"""GET /jobs/lookup: the caller's jobs a short id starts, on SQLite and on Postgres (a range of
the primary key, which each stores its own way)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session

from shared.db.engine import get_engine
from shared.db.models import Job

IDS = [
    uuid.UUID("26a8e187-0000-4000-8000-000000000001"),
    uuid.UUID("26a8e187-ffff-4000-8000-000000000002"),
    uuid.UUID("26a8e188-0000-4000-8000-000000000003"),
    uuid.UUID("f0000000-0000-4000-8000-000000000004"),
]


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    from api.main import create_app

    with Session(get_engine()) as session:
        for job_id in IDS:
            session.add(Job(id=job_id, model="m", dataset="d", deepspeed_config={}, num_gpus=1, training={}))
        session.add(
            Job(
                id=uuid.UUID("26a8e187-5555-4000-8000-000000000005"),
                owner="someone-else",
                model="m",
                dataset="d",
                deepspeed_config={},
                num_gpus=1,
                training={},
            )
        )
        session.commit()
    with TestClient(create_app()) as c:
        yield c


def lookup(client: TestClient, prefix: str) -> tuple[list[str], int]:
    answer = client.get("/jobs/lookup", params={"id_prefix": prefix})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return sorted(job["id"] for job in body["data"]), body["count"]


def test_a_short_id_finds_the_jobs_it_starts(client: TestClient) -> None:
    first, second, third, last = (str(i) for i in IDS)
    assert lookup(client, "26a8e1870") == ([first], 1)
    assert lookup(client, "26a8e187") == ([first, second], 2)  # not another owner's
    assert lookup(client, "26A8E187-F") == ([second], 1)  # any case, the id's dashes or not
    assert lookup(client, "26a8e18") == ([first, second, third], 3)
    assert lookup(client, "f") == ([last], 1)
    assert lookup(client, str(IDS[2])) == ([third], 1)  # a whole id is a prefix of itself
    assert lookup(client, "0") == ([], 0)
    assert client.get(f"/jobs/{first}").status_code == 200  # the route before it still reads jobs


@pytest.mark.parametrize("bad", ["xyz", "-", "0" * 33, ""])
def test_what_is_no_id_prefix_is_a_422(client: TestClient, bad: str) -> None:
    answer = client.get("/jobs/lookup", params={"id_prefix": bad})
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"] == ["query", "id_prefix"]
