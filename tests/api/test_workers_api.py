"""GET /workers and GET /queues: each worker's hardware, state and job (its id for its owner
only), the queues' waiting jobs, and the gangs waiting for nodes; on SQLite and on Postgres."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session

from shared.db.api_keys import create_key
from shared.db.engine import get_engine
from shared.db.models import Job, JobNode, NodeState, Worker
from shared.jobs.status import JobStatus
from shared.settings import get_settings


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
def client(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    from api.main import create_app

    monkeypatch.setenv("TUNEQ_AUTH", "on")
    monkeypatch.setenv("TUNEQ_WORKER_SEEN_SECONDS", "60")
    get_settings.cache_clear()
    with TestClient(create_app()) as c:
        yield c


def bearer(owner: str) -> dict[str, str]:
    with Session(get_engine()) as session:
        return {"Authorization": f"Bearer {create_key(session=session, owner=owner)[1]}"}


def worker(worker_id: str, **fields: Any) -> Worker:
    values: dict[str, Any] = {
        "hostname": f"host-{worker_id}",
        "accelerator": "cuda",
        "device_count": 2,
        "device_memory_bytes": 80 * 2**30,
        "bf16_supported": True,
        "queue": "tuneq-2dev",
        "address": f"10.0.0.{len(worker_id)}",
        "idle_since": now(),
        "last_seen_at": now(),
    }
    return Worker(id=worker_id, **{**values, **fields})


def job(owner: str, **fields: Any) -> Job:
    values: dict[str, Any] = {"model": "/models/gpt", "dataset": "/data/t.jsonl", "deepspeed_config": {}}
    return Job(owner=owner, training={}, **{"num_gpus": 1, **values, **fields})


def add(*rows: Any) -> None:
    with Session(get_engine(), expire_on_commit=False) as session:
        session.add_all(rows)
        session.commit()


def by_id(answer: Any) -> dict[str, dict[str, Any]]:
    assert answer.status_code == 200, answer.text
    return {w["id"]: w for w in answer.json()["data"]}


def test_workers_show_state_and_only_the_callers_job_ids(client: TestClient) -> None:
    alice, bob = bearer("alice"), bearer("bob")
    alices, bobs = job("alice", status=JobStatus.running, worker_id="w-busy-a"), job("bob", status=JobStatus.running)
    bobs.worker_id = "w-busy-b"
    gang = job("bob", status=JobStatus.running, num_nodes=2, worker_id="w-node-0", attempts=1)
    add(alices, bobs, gang)
    nodes = [
        JobNode(job_id=gang.id, attempt=1, node_rank=r, worker_id=f"w-node-{r}", address="a", lease_expires_at=now())
        for r in (0, 1)
    ]
    nodes[1].state = NodeState.running
    add(
        worker("w-idle", device_count=8, accelerator="cpu", bf16_supported=None),
        worker("w-busy-a", idle_since=None),
        worker("w-busy-b", idle_since=None),
        worker("w-node-0", idle_since=None),
        worker("w-node-1", idle_since=None),
        worker("w-disk", unavailable="free disk 200 MB is below TUNEQ_MIN_FREE_DISK_MB (1024)"),
        worker("w-lost", last_seen_at=now() - timedelta(seconds=600)),
        worker("w-stopped", stopped_at=now(), last_seen_at=now()),
        *nodes,
    )

    seen = by_id(client.get("/workers", headers=alice))
    assert {w: seen[w]["state"] for w in seen} == {
        "w-idle": "idle",
        "w-busy-a": "busy",
        "w-busy-b": "busy",
        "w-node-0": "busy",
        "w-node-1": "busy",
        "w-disk": "unavailable",
        "w-lost": "unavailable",
        "w-stopped": "stopped",
    }
    assert seen["w-busy-a"]["job_id"] == str(alices.id)  # alice's own job
    assert seen["w-busy-b"]["job_id"] is None  # bob's: busy, no id
    assert seen["w-node-0"]["job_id"] is None and seen["w-node-1"]["job_id"] is None
    assert "TUNEQ_MIN_FREE_DISK_MB" in seen["w-disk"]["unavailable_reason"]
    assert "TUNEQ_WORKER_SEEN_SECONDS" in seen["w-lost"]["unavailable_reason"]
    idle = seen["w-idle"]
    assert (idle["accelerator"], idle["device_count"], idle["queue"], idle["job_id"]) == ("cpu", 8, "tuneq-2dev", None)
    assert idle["last_seen_at"].endswith(("Z", "+00:00")) and idle["device_memory_bytes"] == 80 * 2**30
    assert client.get("/workers", headers=alice).json()["seen_seconds"] == 60

    seen = by_id(client.get("/workers", headers=bob))
    assert seen["w-busy-b"]["job_id"] == str(bobs.id)
    assert seen["w-node-1"]["job_id"] == str(gang.id) and seen["w-node-0"]["job_id"] == str(gang.id)
    assert seen["w-busy-a"]["job_id"] is None
    assert str(alices.id) not in client.get("/workers", headers=bob).text


def test_queues_count_waiting_jobs_and_gangs_show_their_owner_only(client: TestClient) -> None:
    alice, bob = bearer("alice"), bearer("bob")
    early = now() - timedelta(seconds=300)
    gang = job("alice", num_nodes=3, num_gpus=2, created_at=now() - timedelta(seconds=90))
    others_gang = job("bob", num_nodes=2, created_at=now() - timedelta(seconds=30))
    add(
        job("alice", queue="tuneq-2dev", enqueued_at=early, created_at=early),
        job("bob", queue="tuneq-2dev", enqueued_at=now() - timedelta(seconds=10)),
        job("bob", queue=None, num_gpus=16),  # no live worker fits it: unpublished
        job("alice", queue="tuneq-2dev", status=JobStatus.running),  # not waiting
        gang,
        others_gang,
        worker("w-a"),
        worker("w-b", gang_job_id=gang.id),
        worker("w-8", device_count=8, queue="tuneq-8dev", idle_since=None),
        worker("w-gone", queue="tuneq-4dev", last_seen_at=now() - timedelta(seconds=600)),
    )
    answer = client.get("/queues", headers=alice)
    assert answer.status_code == 200, answer.text
    queues = {q["name"]: q for q in answer.json()["data"]}
    assert set(queues) == {"tuneq-2dev", "tuneq-8dev", None}  # a lost worker's queue has no consumer
    two = queues["tuneq-2dev"]
    assert (two["queued"], two["workers"]) == (2, 2)
    assert 290 <= two["oldest_wait_seconds"] <= 400  # the oldest one's, every owner's jobs counted
    assert (queues["tuneq-8dev"]["queued"], queues["tuneq-8dev"]["workers"]) == (0, 1)
    assert queues["tuneq-8dev"]["oldest_wait_seconds"] is None
    assert (queues[None]["queued"], queues[None]["workers"]) == (1, 0)

    gangs = answer.json()["gangs"]
    assert [(g["job_id"], g["num_nodes"], g["num_gpus"], g["held_workers"]) for g in gangs] == [
        (str(gang.id), 3, 2, 1),
        (None, 2, 1, 0),  # bob's: no id for alice
    ]
    assert gangs[0]["wait_seconds"] >= 85
    assert [g["job_id"] for g in client.get("/queues", headers=bob).json()["gangs"]] == [None, str(others_gang.id)]
    held = by_id(client.get("/workers", headers=alice))["w-b"]
    assert (held["state"], held["held_for_gang"]) == ("idle", True)


@pytest.mark.parametrize("path", ["/workers", "/queues"])
def test_workers_and_queues_ask_for_a_key(client: TestClient, path: str) -> None:
    answer = client.get(path)
    assert answer.status_code == 401
    assert client.get(path, headers={"Authorization": f"Bearer tq_{uuid.uuid4().hex}"}).status_code == 401
