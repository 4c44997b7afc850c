"""A multi-node job's failures are the gang's: a node's worker SIGKILLed, a rank SIGSTOPped.
Every rank on every node stops within the bound (ARCHITECTURE.md, "Gang state machine"), and
the job resumes on two workers from its newest committed checkpoint, no step repeated."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.services import LoopbackS3, fresh_postgres_schema

from .conftest import s3_artifacts_env
from .harness import Tuneq, start_cluster, wait_for_workers, wait_gone, wait_until
from .test_multi_node import body

pytestmark = [pytest.mark.slow, pytest.mark.spread]

STEPS = 160
# Short leases and a short stall bound keep the waits to seconds.
FAST = {"TUNEQ_LEASE_TTL_SECONDS": "6", "TUNEQ_RANK_STALL_SECONDS": "6", "TUNEQ_GANG_START_SECONDS": "60"}


@pytest.fixture
def data(tmp_path: Path) -> Path:
    from cli.samples import build_tiny_model, write_text_dataset

    data = tmp_path / "data"
    build_tiny_model(data / "tiny-gpt-neo")
    write_text_dataset(data / "train.jsonl", records=64)
    return data


def long_gang(data: Path) -> dict[str, Any]:
    return body(
        data,
        num_gpus=1,
        num_nodes=2,
        training={"max_seq_length": 48, "epochs": 100, "max_steps": STEPS, "checkpoint_every_steps": 10, "seed": 7},
    )


def events(tuneq: Tuneq, job_id: str, kind: str) -> list[dict[str, Any]]:
    """The job's events of one type, every page."""
    found, cursor = [], 0
    while True:
        page = tuneq.get(f"/jobs/{job_id}/events?after={cursor}&limit=1000")
        found += [e["data"] for e in page["data"] if e["type"] == kind]
        if page["next_cursor"] is None:
            return found
        cursor = page["next_cursor"]


def committed(tuneq: Tuneq, job_id: str) -> list[int]:
    return [c["step"] for c in tuneq.get(f"/jobs/{job_id}/checkpoints")["data"] if c["kind"] == "deepspeed"]


def worker_of(tuneq: Tuneq, worker_id: str) -> Any:
    """The harness's process of the worker ``host:pid``."""
    pid = int(worker_id.rpartition(":")[2])
    return next(p for p in tuneq.processes if p.pid == pid)


def check_resumed_whole(tuneq: Tuneq, job_id: str, *, committed_before: int) -> dict[str, Any]:
    """The job succeeded on a second attempt that resumed from a checkpoint committed no earlier
    than ``committed_before`` (the one seen before the failure), every step recorded once."""
    done = tuneq.wait(job_id, timeout=400)
    assert done["status"] == "succeeded", (done["error"], tuneq.log_tail())
    assert done["attempts"] == 2 and done["step"] == STEPS
    metrics = tuneq.get(f"/jobs/{job_id}/metrics?limit=1000")["data"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # every step once
    (resumed,) = events(tuneq, job_id, "resumed")
    assert resumed["from_step"] % 10 == 0 and resumed["from_step"] >= committed_before
    wait_until(
        lambda: [n["state"] for n in tuneq.job(job_id)["nodes"]] == ["finished", "finished"],
        timeout=30,
        what="the nodes never finished",
        tuneq=tuneq,
    )
    return done


def test_a_lost_nodes_worker_stops_the_gang_and_it_resumes_on_two_workers(
    tmp_path: Path, data: Path, postgres_url: str, redis_url: str, loopback_s3: LoopbackS3
) -> None:
    database = fresh_postgres_schema(postgres_url)
    store = s3_artifacts_env(loopback_s3, "lost-node")
    tuneq = start_cluster(tmp_path, data, database=database, broker=redis_url, store=store, hosts=2, **FAST)
    try:
        job = tuneq.submit(long_gang(data))
        (first, *_) = wait_until(lambda: committed(tuneq, job["id"]), timeout=240, what="no checkpoint", tuneq=tuneq)
        nodes = tuneq.job(job["id"])["nodes"]
        ranks = tuneq.ranks_of(job["id"])
        assert len(ranks) == 2
        assert tuneq.job(job["id"])["status"] == "running"
        tuneq.kill(worker_of(tuneq, nodes[1]["worker_id"]))  # node 1's worker, and its pool, SIGKILL
        killed = time.monotonic()
        # Node 0's rank goes too: it loses its peer, and its worker ends the attempt.
        assert wait_gone(ranks, timeout=30) == []
        stopped_within = time.monotonic() - killed
        assert stopped_within < 30
        tuneq.start_worker(TUNEQ_HOME=str(tmp_path / "new-host"))  # an empty home: the checkpoint comes from S3
        done = check_resumed_whole(tuneq, job["id"], committed_before=first)
        assert nodes[1]["worker_id"] not in {n["worker_id"] for n in done["nodes"]}
        warnings = [e["message"] for e in events(tuneq, job["id"], "warning")]
        assert any("node" in w for w in warnings), warnings
    finally:
        tuneq.stop()


def test_a_stopped_rank_is_detected_and_the_gang_resumes(
    tmp_path: Path, data: Path, postgres_url: str, redis_url: str, loopback_s3: LoopbackS3
) -> None:
    database = fresh_postgres_schema(postgres_url)
    store = s3_artifacts_env(loopback_s3, "stopped-rank")
    tuneq = start_cluster(tmp_path, data, database=database, broker=redis_url, store=store, hosts=2, **FAST)
    try:
        job = tuneq.submit(long_gang(data))
        (first, *_) = wait_until(lambda: committed(tuneq, job["id"]), timeout=240, what="no checkpoint", tuneq=tuneq)
        ranks = tuneq.ranks_of(job["id"])
        stopped = next(p for p in ranks if "rank 1/2" in " ".join(p.cmdline()))
        os.kill(stopped.pid, signal.SIGSTOP)  # alive, but frozen: its peer waits in a collective
        try:
            assert wait_gone(ranks, timeout=60) == []  # the stall bound (6 s) plus a poll and the kill
        finally:
            if psutil.pid_exists(stopped.pid):
                os.kill(stopped.pid, signal.SIGCONT)
        wait_for_workers(tuneq, database, 2)
        done = check_resumed_whole(tuneq, job["id"], committed_before=first)
        warnings = [e["message"] for e in events(tuneq, done["id"], "warning")]
        assert any("showed no sign of life" in w for w in warnings), warnings
    finally:
        tuneq.stop()


def test_deepspeeds_launcher_runs_a_gang_without_ssh(
    tmp_path: Path, data: Path, postgres_url: str, redis_url: str, loopback_s3: LoopbackS3
) -> None:
    """TUNEQ_LAUNCHER=deepspeed: each node's worker runs `deepspeed --no_ssh --node_rank k
    --hostfile ...` with the same hostfile, instead of forking from the warm start."""
    database = fresh_postgres_schema(postgres_url)
    store = s3_artifacts_env(loopback_s3, "launcher")
    tuneq = start_cluster(
        tmp_path, data, database=database, broker=redis_url, store=store, hosts=2, TUNEQ_LAUNCHER="deepspeed"
    )
    try:
        done = tuneq.wait(tuneq.submit(body(data, num_gpus=1, num_nodes=2))["id"], timeout=300)
        assert done["status"] == "succeeded", (done["error"], tuneq.log_tail())
        hostfiles = sorted(tmp_path.glob(f"host-*/runs/{done['id']}/hostfile"))
        assert len(hostfiles) == 2 and {h.read_text() for h in hostfiles} == {"node-0 slots=1\nnode-1 slots=1\n"}
        lines = [e["line"] for e in events(tuneq, done["id"], "log")]
        assert any("--no_ssh" in line or "node_rank" in line for line in lines), lines[:40]
    finally:
        tuneq.stop()
