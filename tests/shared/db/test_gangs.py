"""Gang scheduling in SQL, on SQLite and on Postgres: all-or-none placement, holds that cannot
deadlock, one start per node, and release of the whole gang."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlmodel import Session, col, select

from shared.db.engine import get_engine
from shared.db.gangs import (
    claim_node,
    current_nodes,
    finish_node,
    gangs_waiting,
    lost_nodes,
    open_nodes,
    place_gangs,
    release_gang,
    renew_node_lease,
)
from shared.db.lifecycle import (
    claim_job,
    finish_pause,
    register_worker,
    request_pause,
    request_resume,
    set_worker_idle,
)
from shared.db.models import Job, JobNode, NodeState, Worker, utcnow
from shared.jobs.status import JobStatus
from shared.queue import node_queue
from shared.settings import get_settings


def session() -> Session:
    return Session(get_engine(), expire_on_commit=False)


def new_job(*, num_nodes: int = 2, num_gpus: int = 1, max_restarts: int = 2) -> Job:
    with session() as s:
        job = Job(
            model="a/b",
            dataset="/d",
            deepspeed_config={},
            num_gpus=num_gpus,
            num_nodes=num_nodes,
            training={},
            max_restarts=max_restarts,
        )
        s.add(job)
        s.commit()
        return job


def workers(*names: str, devices: int = 1) -> None:
    with session() as s:
        for name in names:
            register_worker(
                session=s,
                worker_id=name,
                hostname=name,
                accelerator="cpu",
                device_count=devices,
                queue=f"tuneq-{devices}gpu",
                address=f"10.0.0.{len(name)}",
            )


def place() -> list[tuple[str, int, int, str]]:
    with session() as s:
        return [
            (str(n.job_id), n.attempt, n.node_rank, n.queue) for n in place_gangs(session=s, settings=get_settings())
        ]


def kept_for(name: str) -> str | None:
    with session() as s:
        worker = s.get(Worker, name)
        assert worker is not None
        return str(worker.gang_job_id) if worker.gang_job_id else None


def status(job: Job) -> JobStatus:
    with session() as s:
        found = s.get(Job, job.id)
        assert found is not None
        return found.status


def start_placed_gang(job: Job) -> list[JobNode]:
    """Place ``job``'s gang and start each of its nodes on its worker (attempt 1)."""
    place()
    with session() as s:
        nodes = current_nodes(session=s, job=s.get(Job, job.id))  # type: ignore[arg-type]
        for node in nodes:
            claim_node(
                session=s, job_id=job.id, attempt=1, node_rank=node.node_rank, worker_id=node.worker_id, lease_ttl=30
            )
    return nodes


def test_a_gang_is_placed_on_as_many_idle_workers_at_once(database_url: str) -> None:
    workers("w1", "w2", "w3")
    job = new_job(num_nodes=2)
    starts = place()
    settings = get_settings()
    assert [(node, rank) for _, node, rank, _ in starts] == [(1, 0), (1, 1)]
    assert {queue for *_, queue in starts} <= {node_queue(settings, w) for w in ("w1", "w2", "w3")}
    with session() as s:
        found = s.get(Job, job.id)
        assert found is not None and found.status == JobStatus.running and found.attempts == 1
        nodes = current_nodes(session=s, job=found)
    assert [n.node_rank for n in nodes] == [0, 1] and all(n.state == NodeState.reserved for n in nodes)
    assert nodes[0].port is not None and nodes[1].port is None  # node 0 is the rendezvous master
    first, last = settings.gang_port_range
    assert first <= nodes[0].port <= last
    placed = {n.worker_id for n in nodes}
    assert all(kept_for(w) == str(job.id) for w in placed)
    assert place() == []  # placed once


def test_a_gang_waits_whole_while_too_few_workers_are_idle_and_holds_them(database_url: str) -> None:
    workers("w1", "w2")
    with session() as s:
        set_worker_idle(session=s, worker_id="w2", idle=False)  # running a one-node job
    job = new_job(num_nodes=2)
    assert place() == []
    assert status(job) == JobStatus.queued
    assert kept_for("w1") == str(job.id)  # held: it takes no other job meanwhile
    with session() as s:
        assert gangs_waiting(session=s) == 1
    one_node = new_job(num_nodes=1)
    with session() as s:
        assert claim_job(session=s, job_id=one_node.id, worker_id="w1", lease_ttl=60) is None
    with session() as s:
        set_worker_idle(session=s, worker_id="w2", idle=True)  # its job ended
    assert len(place()) == 2
    assert status(job) == JobStatus.running


def test_two_gangs_and_three_workers_never_deadlock(database_url: str) -> None:
    """Only the oldest waiting gang holds workers: as three busy workers free up one by one,
    the first gang gets two and the second can never hold half of what the first needs."""
    workers("w1", "w2", "w3")
    with session() as s:
        for name in ("w1", "w2", "w3"):
            set_worker_idle(session=s, worker_id=name, idle=False)
    first, second = new_job(num_nodes=2), new_job(num_nodes=2)
    for name, placed in (("w1", set()), ("w2", {str(first.id)}), ("w3", set())):
        with session() as s:
            set_worker_idle(session=s, worker_id=name, idle=True)
        assert {job for job, *_ in place()} == placed
    assert status(first) == JobStatus.running and status(second) == JobStatus.queued
    assert kept_for("w3") == str(second.id)  # the oldest gang still waiting holds the third
    # The first gang's nodes end; its workers are free and the second gang gets two of the three.
    with session() as s:
        for node in current_nodes(session=s, job=s.get(Job, first.id)):  # type: ignore[arg-type]
            finish_node(session=s, job_id=first.id, attempt=1, node_rank=node.node_rank, worker_id=node.worker_id)
        s.execute(update(Job).where(col(Job.id) == first.id).values(status=JobStatus.succeeded))
        s.commit()
    assert {job for job, *_ in place()} == {str(second.id)}
    assert status(second) == JobStatus.running


def test_a_paused_gang_holds_no_worker_and_a_pausing_one_keeps_its_nodes_until_they_finish(
    database_url: str,
) -> None:
    workers("w1", "w2")
    waiting = new_job(num_nodes=3)
    place()
    assert kept_for("w1") == str(waiting.id)
    with session() as s:
        request_pause(session=s, job_id=waiting.id)
    place()  # a paused gang waits for nothing: the workers it held are free
    assert status(waiting) == JobStatus.paused and kept_for("w1") is None and kept_for("w2") is None

    job = new_job(num_nodes=2)
    nodes = start_placed_gang(job)
    with session() as s:
        request_pause(session=s, job_id=job.id)
        # While the ranks checkpoint, every node keeps its lease; node 0's worker waits for the
        # other nodes (their shares of the pause checkpoint) before it pauses the job.
        args = {"job_id": job.id, "attempt": 1, "lease_ttl": 30}
        assert renew_node_lease(session=s, node_rank=1, worker_id=nodes[1].worker_id, **args)
        assert open_nodes(session=s, job_id=job.id, attempt=1) == [0, 1]
        finish_node(session=s, job_id=job.id, attempt=1, node_rank=1, worker_id=nodes[1].worker_id)
        assert open_nodes(session=s, job_id=job.id, attempt=1) == [0]
        assert finish_pause(session=s, job_id=job.id, attempt=1, step=5)
        finish_node(session=s, job_id=job.id, attempt=1, node_rank=0, worker_id=nodes[0].worker_id)
    assert status(job) == JobStatus.paused and kept_for(nodes[0].worker_id) is None
    assert place() == []  # nor is a paused gang placed
    with session() as s:
        request_resume(session=s, job_id=job.id)
    assert {(job_id, attempt) for job_id, attempt, *_ in place()} == {(str(job.id), 2)}


def test_the_oldest_gang_holds_workers_as_they_free_up_and_younger_work_backfills(database_url: str) -> None:
    workers("w1", "w2", "w3")
    with session() as s:
        for name in ("w2", "w3"):
            set_worker_idle(session=s, worker_id=name, idle=False)
    big = new_job(num_nodes=3)
    assert place() == []
    assert kept_for("w1") == str(big.id)
    small = new_job(num_nodes=2)  # younger: must not take the held worker
    assert place() == []
    assert status(small) == JobStatus.queued and kept_for("w1") == str(big.id)
    with session() as s:
        for name in ("w2", "w3"):
            set_worker_idle(session=s, worker_id=name, idle=True)
    starts = place()
    assert {job for job, *_ in starts} == {str(big.id)} and len(starts) == 3


def test_a_worker_that_took_a_job_meanwhile_rolls_the_whole_reservation_back(database_url: str) -> None:
    workers("w1", "w2")
    job = new_job(num_nodes=2)
    other = new_job(num_nodes=1)
    # w2 claims a one-node job before the placement: the placement must not take w1 alone.
    with session() as s:
        set_worker_idle(session=s, worker_id="w2", idle=False)
        assert claim_job(session=s, job_id=other.id, worker_id="w2", lease_ttl=60) is not None
    assert place() == []
    with session() as s:
        assert s.exec(select(JobNode).where(JobNode.job_id == job.id)).all() == []
    assert status(job) == JobStatus.queued


def test_a_node_starts_once_on_its_own_worker_and_only_for_its_attempt(database_url: str) -> None:
    workers("w1", "w2")
    job = new_job(num_nodes=2)
    starts = place()
    with session() as s:
        nodes = current_nodes(session=s, job=s.get(Job, job.id))  # type: ignore[arg-type]
    node1 = nodes[1]
    args = {"job_id": job.id, "node_rank": 1, "lease_ttl": 30}
    with session() as s:
        assert claim_node(session=s, attempt=1, worker_id=nodes[0].worker_id, **args) is None  # not its node
        assert claim_node(session=s, attempt=2, worker_id=node1.worker_id, **args) is None  # a stale attempt
        claimed = claim_node(session=s, attempt=1, worker_id=node1.worker_id, **args)
        assert claimed is not None and [n.node_rank for n in claimed[1]] == [0, 1]
        assert claim_node(session=s, attempt=1, worker_id=node1.worker_id, **args) is None  # a redelivery
        assert renew_node_lease(session=s, attempt=1, worker_id=node1.worker_id, **args)
    assert len(starts) == 2


def test_a_lost_node_releases_the_whole_gang_and_frees_its_workers(database_url: str) -> None:
    workers("w1", "w2")
    job = new_job(num_nodes=2, max_restarts=1)
    start_placed_gang(job)
    with session() as s:
        assert lost_nodes(session=s, now=utcnow()) == []
        lost = lost_nodes(session=s, now=utcnow() + timedelta(seconds=60))
        assert [node.node_rank for _, node in lost] == [0, 1]
        found, _ = lost[1]
        assert release_gang(session=s, job=found, reason="node 1 lost", failed_node=1) == JobStatus.queued
        assert release_gang(session=s, job=found, reason="again", failed_node=0) is None  # once
    with session() as s:
        rows = s.exec(select(JobNode).where(JobNode.job_id == job.id).order_by(col(JobNode.node_rank))).all()
        assert [r.state for r in rows] == [NodeState.released, NodeState.released]
        assert rows[1].error_message == "node 1 lost"
        # A node whose gang was released has lost the job at its next renewal.
        assert not renew_node_lease(
            session=s, job_id=job.id, attempt=1, node_rank=0, worker_id=rows[0].worker_id, lease_ttl=30
        )
    assert kept_for("w1") is None and kept_for("w2") is None
    assert status(job) == JobStatus.queued
    # Placed again as attempt 2, whole.
    assert [(attempt, rank) for _, attempt, rank, _ in place()] == [(2, 0), (2, 1)]


@pytest.mark.parametrize("started", [False, True])
def test_a_node_not_started_by_the_deadline_counts_as_lost(database_url: str, started: bool) -> None:
    workers("w1", "w2")
    job = new_job(num_nodes=2)
    place()
    if started:
        with session() as s:
            node = current_nodes(session=s, job=s.get(Job, job.id))[0]  # type: ignore[arg-type]
            claim_node(session=s, job_id=job.id, attempt=1, node_rank=0, worker_id=node.worker_id, lease_ttl=3600)
    deadline = utcnow() + timedelta(seconds=get_settings().gang_start_seconds + 1)
    with session() as s:
        assert [n.node_rank for _, n in lost_nodes(session=s, now=deadline)] == ([1] if started else [0, 1])
