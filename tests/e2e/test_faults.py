"""Faults a real host has, on real processes: the database going away under a running job."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import create_engine, text

from cli.samples import build_tiny_model, seed_config, write_text_dataset
from tests.services import DatabaseLink, fresh_postgres_schema
from worker.tasks import WORKER_STOP_DEADLINE_SECONDS

from .harness import Tuneq, wait_gone, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.spread]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    data = tmp_path / "home" / "data"
    build_tiny_model(data / "tiny-gpt-neo")
    write_text_dataset(data / "varied.jsonl", records=96)
    return data


@pytest.fixture
def link(postgres_url: str) -> Iterator[DatabaseLink]:
    from sqlalchemy.engine import make_url

    target = make_url(postgres_url)
    relay = DatabaseLink(target.host or "127.0.0.1", target.port or 5432)
    yield relay
    relay.close()


def restart_database(link: DatabaseLink, postgres_url: str, *, down_for: float) -> None:
    """What ``pg_ctlcluster … restart`` does to tuneq's connections: the server ends each one
    (``AdminShutdown``), then refuses connections for ``down_for`` seconds."""
    ports = link.upstream_ports()
    admin = create_engine(postgres_url)
    with admin.begin() as conn:
        conn.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE client_port = ANY(:ports)"),
            {"ports": ports},
        )
    admin.dispose()
    link.cut(down_for)


def test_a_database_restart_mid_run_neither_fails_nor_restarts_the_job(
    tmp_path: Path, data: Path, postgres_url: str, link: DatabaseLink
) -> None:
    url = link.url(fresh_postgres_schema(postgres_url))
    service = Tuneq(home=tmp_path / "home", env={"TUNEQ_DATABASE_URL": url}, split=True).start()
    try:
        job = service.submit(
            {
                "model": str(data / "tiny-gpt-neo"),
                "dataset": str(data / "varied.jsonl"),
                "deepspeed_config": seed_config(fp16=False),
                "training": {"epochs": 500, "max_steps": 400, "max_seq_length": 64, "checkpoint_every_steps": 100},
            }
        )
        deadline = time.monotonic() + 300
        while service.job(job["id"])["step"] < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        restart_database(link, postgres_url, down_for=3)
        # While it is down, the API answers 503 with Retry-After (GET /jobs is read, not cached).
        during = service.client.get("/jobs")
        assert during.status_code == 503, during.text
        assert int(during.headers["Retry-After"]) > 0 and "retry" in during.json()["detail"]
        job = service.wait(job["id"], timeout=600)
        assert job["status"] == "succeeded", f"{job['error']}\n{service.log_tail()}"
        assert job["attempts"] == 1  # never requeued: the attempt rode the outage out
        steps = [m["step"] for m in service.get(f"/jobs/{job['id']}/metrics")["data"]]
        assert steps == list(range(1, 401))  # nothing the ranks reported during the outage was lost
        worker_log = service.log.read_text(errors="replace")
        assert "the database is unreachable" in worker_log and "the database is back" in worker_log
    finally:
        service.stop()


def test_a_rank_the_kernel_kills_requeues_the_job_saying_why(tmp_path: Path, data: Path) -> None:
    """The OOM killer's SIGKILL of one rank is the host's failure, not the job's: the job is
    retried from its checkpoint, and its events say which rank, which signal and the likely cause."""
    service = Tuneq(home=tmp_path / "home").start()
    try:
        job = service.submit(
            {
                "model": str(data / "tiny-gpt-neo"),
                "dataset": str(data / "varied.jsonl"),
                "num_gpus": 2,
                "deepspeed_config": seed_config(fp16=False, train_batch_size=2),
                "training": {"epochs": 200, "max_steps": 40, "max_seq_length": 64, "checkpoint_every_steps": 5},
            }
        )
        deadline = time.monotonic() + 300
        while not service.get(f"/jobs/{job['id']}/checkpoints")["data"] and time.monotonic() < deadline:
            time.sleep(0.2)
        rank_1 = [p for p in service.ranks_of(job["id"]) if "rank 1/2" in " ".join(p.cmdline())]
        assert len(rank_1) == 1, service.log_tail()
        rank_1[0].send_signal(signal.SIGKILL)  # what the kernel's OOM killer sends
        job = service.wait(job["id"], timeout=600)
        assert job["status"] == "succeeded", f"{job['error']}\n{service.log_tail()}"
        assert job["attempts"] == 2
        events = service.get(f"/jobs/{job['id']}/events?limit=1000")["data"]
        warnings = [e["data"]["message"] for e in events if e["type"] == "warning"]
        assert any("rank 1 was killed by SIGKILL (signal 9)" in w and "out of memory" in w for w in warnings), warnings
    finally:
        service.stop()


def test_a_worker_that_stops_is_no_longer_counted_live(tmp_path: Path) -> None:
    """It marks its row stopped on its way down, instead of looking live (and idle) until its
    heartbeat ages out, which made every reconciler republish its queue's waiting jobs.

    And it stops cleanly when the SIGTERM reaches its whole process group (systemd's default),
    its pool child included: that child used to die of it, logging an ERROR, and now and then
    while it held the lock of Celery's result queue, which left the worker waiting for its stop
    deadline (60 s) and then killing itself. Nor does it start a warm start on its way down:
    Celery forked a new pool child for the one the SIGTERM ended, and that child's warm start
    imported torch for seconds of CPU, and outlived the worker."""
    service = Tuneq(home=tmp_path / "home", split=True).start()
    try:

        def live_workers() -> float:
            for line in service.client.get("/metrics").text.splitlines():
                if line.startswith("tuneq_workers "):
                    return float(line.split()[1])
            raise AssertionError("no tuneq_workers on /metrics")

        deadline = time.monotonic() + 120
        while live_workers() != 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert live_workers() == 1
        warm_start = wait_until(service.warm_starts, timeout=60, what="the worker's warm start started", tuneq=service)
        worker = service.processes[1]
        stopped_at = service.log.stat().st_size
        os.killpg(worker.pid, signal.SIGTERM)
        # Meanwhile, and a little after, every warm start seen is the one the worker had. (The
        # deadline only bounds a failing run: one that waited for the worker's stop deadline.)
        seen: set[int] = set()
        deadline = time.monotonic() + WORKER_STOP_DEADLINE_SECONDS + 30
        while worker.poll() is None and time.monotonic() < deadline:
            seen |= {p.pid for p in service.warm_starts()}
            time.sleep(0.1)
        assert worker.poll() is not None, service.log_tail()
        with service.log.open("rb") as log:
            log.seek(stopped_at)
            stop_log = log.read().decode(errors="replace")
        assert worker.returncode == 0 and " ERROR" not in stop_log and "ERROR/" not in stop_log, stop_log
        assert live_workers() == 0  # at once, not TUNEQ_WORKER_SEEN_SECONDS later
        gone_at = time.monotonic()
        while time.monotonic() < gone_at + 3:
            seen |= {p.pid for p in service.warm_starts()}
            time.sleep(0.1)
        assert seen <= {p.pid for p in warm_start}, service.log_tail()
        assert wait_gone(warm_start, timeout=10) == []
    finally:
        service.stop()


def test_a_worker_whose_disk_is_full_takes_no_job_and_says_so(tmp_path: Path, data: Path) -> None:
    """A worker below TUNEQ_MIN_FREE_DISK_MB leaves the job queued (it used to fail every job
    within milliseconds, draining the queue); once a worker with room is there, the job runs."""
    full = {"TUNEQ_MIN_FREE_DISK_MB": str(10**12)}  # more than any disk has: this one is "full"
    service = Tuneq(home=tmp_path / "home", env=full, split=True).start()
    try:
        job = service.submit(
            {
                "model": str(data / "tiny-gpt-neo"),
                "dataset": str(data / "varied.jsonl"),
                "deepspeed_config": seed_config(fp16=False),
                "training": {"max_steps": 3, "max_seq_length": 64},
            }
        )
        deadline = time.monotonic() + 120
        metrics = ""
        while "tuneq_workers_unavailable{" not in metrics and time.monotonic() < deadline:
            metrics = service.client.get("/metrics").text
            time.sleep(0.5)
        assert "TUNEQ_MIN_FREE_DISK_MB" in metrics and "\ntuneq_workers 0.0" in metrics, metrics
        time.sleep(5)
        assert service.job(job["id"])["status"] == "queued"  # not claimed, not failed
        worker = service.processes[1]
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=WORKER_STOP_DEADLINE_SECONDS + 30)
        service.processes.remove(worker)
        service.env.pop("TUNEQ_MIN_FREE_DISK_MB")
        service.start_worker()  # a worker with room
        done = service.wait(job["id"], timeout=300)
        assert done["status"] == "succeeded" and done["attempts"] == 1, f"{done['error']}\n{service.log_tail()}"
        worker_log = service.log.read_text(errors="replace")
        assert "takes no jobs: the disk holding TUNEQ_HOME" in worker_log
    finally:
        service.stop()


def _tree_until(service: Tuneq, seconds: float) -> list[psutil.Process]:
    """Every process of the service's tree seen during ``seconds`` (start-up forks and execs)."""
    seen: dict[tuple[int, float], psutil.Process] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for process in service.descendants():
            with contextlib.suppress(psutil.Error):
                seen.setdefault((process.pid, process.create_time()), process)
        time.sleep(0.05)
    return list(seen.values())


@pytest.mark.parametrize("after", [0.3, 1.0, 2.5, 5.0])
def test_dev_stopped_at_any_point_of_its_start_up_leaves_no_process(tmp_path: Path, after: float) -> None:
    """SIGTERM to `tuneq dev` while the API, the Celery worker, its pool child and the warm
    start are still coming up (the API answers after about 2 s here, the warm start has its
    imports after about 5): the whole tree is gone within dev's documented 30 s grace. Every
    process started with the service's environment counts, seen in the tree or not: dev once
    spawned the API and the worker before it handled SIGTERM, and a SIGTERM in between orphaned
    both."""
    service = Tuneq(home=tmp_path / "home").launch()
    tree = _tree_until(service, after)
    dev = service.processes[0]
    dev.send_signal(signal.SIGTERM)
    dev.wait(timeout=45)
    left = wait_gone(tree + service.environment_processes(), timeout=10)
    assert left == [], [" ".join(p.cmdline()) for p in left]
    service.client.close()


def test_serve_stopped_with_a_plan_in_flight_answers_it_503_and_leaves_no_process(tmp_path: Path, data: Path) -> None:
    """A plan still running when the stop's grace ends used to get no answer at all (the client saw
    its connection closed: a protocol error), and its spawned child and multiprocessing's resource
    tracker used to outlive the API. A grace of 1 s, and a dataset of 100 000 records whose
    tokenizing alone takes longer, keep the plan in flight past it (and the test short)."""
    write_text_dataset(data / "large.jsonl", records=100_000)
    service = Tuneq(home=tmp_path / "home", split=True, env={"TUNEQ_API_STOP_GRACE_SECONDS": "1"}).start(workers=0)
    plan_body = {
        "model": str(data / "tiny-gpt-neo"),
        "dataset": str(data / "large.jsonl"),
        "deepspeed_config": seed_config(fp16=False),
    }
    answers: list[httpx.Response | httpx.HTTPError] = []

    def plan() -> None:
        try:
            answers.append(service.client.post("/jobs/plan", json=plan_body, timeout=120))
        except httpx.HTTPError as e:
            answers.append(e)

    client = threading.Thread(target=plan)
    client.start()
    deadline = time.monotonic() + 60
    tree: list[psutil.Process] = []
    while not any("multiprocessing" in " ".join(p.cmdline()) for p in tree):  # the plan's child: in flight
        assert time.monotonic() < deadline, service.log_tail()
        tree = service.descendants()
        time.sleep(0.05)
    serve = service.processes[0]
    serve.send_signal(signal.SIGTERM)  # as systemd or `docker stop` would: the main process only
    serve.wait(timeout=30)
    client.join(timeout=30)
    [answer] = answers
    assert isinstance(answer, httpx.Response), f"{answer!r}\n{service.log_tail()}"
    # A 200 would be the plan finished within the grace after all: an answer too.
    assert answer.status_code in (200, 503), answer.text
    if answer.status_code == 503:
        assert answer.headers["Retry-After"] == "5" and "stopping" in answer.json()["detail"]
    left = wait_gone(tree, timeout=10)
    assert left == [], [" ".join(p.cmdline()) for p in left]
    service.client.close()
