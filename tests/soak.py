"""``make soak``: an operator's bad week in a quarter of an hour, on real processes.

A few hundred tiny jobs go through ``tuneq serve`` and two ``tuneq worker`` processes on
Postgres and Redis while Postgres is restarted, Redis is restarted (losing what it held: it
runs without persistence here) and a worker is stopped and replaced. The run passes when:

- every job succeeded exactly once: one ``succeeded`` status event, every step's metrics
  once, and a second attempt only for a job the stopped worker released;
- no valid request got a 5xx other than a ``503`` with ``Retry-After`` (what the API answers
  while its database is away, and what clients retry), and no connection was dropped;
- ``/dev/shm`` and the process table are as they were at the start.

Not part of ``make test``: it restarts this machine's Postgres cluster and Redis server. Run
it on a machine where nothing else uses them (``.ci/run`` starts both the same way).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

from cli.samples import build_tiny_model, seed_config, write_text_dataset
from shared.jobs.status import TERMINAL_STATUSES
from tests.e2e.harness import Tuneq, wait_gone
from tests.services import fresh_postgres_schema
from worker.shm_buffers import BUFFER_PREFIX, SHM_DIR

logger = logging.getLogger("tuneq.soak")

POSTGRES_URL = os.environ.get("TUNEQ_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TUNEQ_SOAK_REDIS_URL", "redis://127.0.0.1:6379/14")
# What belongs to a tuneq deployment in the process table (see ARCHITECTURE.md, process model).
TUNEQ_PROCESS_MARKERS = (
    "cli.main",
    "worker.rank.zygote",
    "worker.rank.train",
    "tuneq rank",
    "celeryd",
    "multiprocessing",
)


class Requests:
    """Every HTTP request of the soak, counted: a 503 with Retry-After is waited out and
    retried; any other 5xx or a dropped connection is a violation."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.statuses: collections.Counter[int] = collections.Counter()
        self.violations: list[str] = []
        self._lock = threading.Lock()

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + 120
        while True:
            try:
                response = self.client.request(method, path, **kwargs)
            except httpx.TransportError as e:
                self._violation(f"{method} {path}: {type(e).__name__}: {e}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
                continue
            with self._lock:
                self.statuses[response.status_code] += 1
            if response.status_code == 503 and "retry-after" in response.headers and time.monotonic() < deadline:
                time.sleep(min(float(response.headers["retry-after"]), 2.0))
                continue
            if response.status_code >= 500:
                self._violation(f"{method} {path}: {response.status_code} {response.text[:200]}")
            return response

    def _violation(self, what: str) -> None:
        logger.error("violation: %s", what)
        with self._lock:
            self.violations.append(what)


def tuneq_processes() -> set[tuple[int, float]]:
    found = set()
    for process in psutil.process_iter(["cmdline", "create_time"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if process.pid != os.getpid() and any(marker in cmdline for marker in TUNEQ_PROCESS_MARKERS):
            found.add((process.pid, process.info["create_time"]))
    return found


def shm_buffers() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{BUFFER_PREFIX}_{os.getuid()}_*")}


def restart_postgres() -> None:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"], check=True, timeout=120)


def restart_redis() -> None:
    subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", "6379", "shutdown", "nosave"], check=False, timeout=30)
    time.sleep(2)
    subprocess.run(
        [
            "redis-server",
            "--daemonize",
            "yes",
            "--bind",
            "127.0.0.1",
            "--port",
            "6379",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        check=True,
        timeout=30,
    )


def job_body(data: Path, steps: int) -> dict[str, Any]:
    return {
        "model": str(data / "tiny-gpt-neo"),
        "dataset": str(data / "train.jsonl"),
        "deepspeed_config": seed_config(fp16=False),
        "training": {"max_steps": steps, "epochs": 100, "max_seq_length": 32},
    }


def run(*, jobs: int, steps: int, submit_every: float, work: Path) -> list[str]:
    """The soak; the list of what went wrong (empty: it passed)."""
    problems: list[str] = []
    shm_before, processes_before = shm_buffers(), tuneq_processes()
    data = work / "home" / "data"
    build_tiny_model(data / "tiny-gpt-neo")
    write_text_dataset(data / "train.jsonl", records=32)
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
    env = {
        "TUNEQ_DATABASE_URL": fresh_postgres_schema(POSTGRES_URL, prefix="soak"),
        "TUNEQ_BROKER_URL": REDIS_URL,
        "TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER": "0",
        "TUNEQ_RECONCILE_SECONDS": "2",
        "TUNEQ_REPUBLISH_AFTER_SECONDS": "10",
        "TUNEQ_LEASE_TTL_SECONDS": "30",
    }
    service = Tuneq(home=work / "home", env=env, split=True).start(workers=2)
    requests = Requests(service.client)
    submitted: list[str] = []
    stops = 0
    try:

        def submit_all() -> None:
            for n in range(jobs):
                key = {"Idempotency-Key": f"soak-{n}-{uuid.uuid4().hex[:8]}"}
                response = requests.call("POST", "/jobs", json=job_body(data, steps), headers=key)
                if response.status_code in (200, 201):
                    submitted.append(response.json()["id"])
                else:
                    problems.append(f"submit {n}: {response.status_code} {response.text[:200]}")
                time.sleep(submit_every)

        submitter = threading.Thread(target=submit_all, name="submitter", daemon=True)
        submitter.start()
        chaos = [(0.2, "restart Postgres"), (0.45, "restart Redis"), (0.7, "stop a worker")]
        started = time.monotonic()
        while True:
            listed = requests.call("GET", "/jobs", params={"limit": 500}).json()["data"]
            done = sum(1 for j in listed if j["status"] in TERMINAL_STATUSES)
            if chaos and done >= chaos[0][0] * jobs:
                _, what = chaos.pop(0)
                logger.info("%d/%d jobs done: %s", done, jobs, what)
                if what == "restart Postgres":
                    restart_postgres()
                elif what == "restart Redis":
                    restart_redis()
                else:
                    worker = service.processes[1]
                    worker.terminate()  # SIGTERM to the worker's main process, as `docker stop` sends
                    worker.wait(timeout=120)
                    service.processes.remove(worker)
                    service.start_worker()
                    stops += 1
            if not submitter.is_alive() and done >= len(submitted) == jobs:
                break
            if time.monotonic() - started > 25 * 60:
                problems.append(f"only {done} of {jobs} jobs ended within 25 minutes")
                break
            time.sleep(2)
        logger.info("all %d jobs ended in %.0fs; checking them", jobs, time.monotonic() - started)
        retried = 0
        for job_id in submitted:
            job = requests.call("GET", f"/jobs/{job_id}").json()
            if job["status"] != "succeeded":
                problems.append(f"job {job_id} {job['status']}: {job['error']}")
                continue
            retried += job["attempts"] - 1
            steps_seen = [m["step"] for m in requests.call("GET", f"/jobs/{job_id}/metrics").json()["data"]]
            if steps_seen != list(range(1, steps + 1)):
                problems.append(f"job {job_id}: steps {steps_seen}")
            events = requests.call("GET", f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
            ends = [e for e in events if e["type"] == "status" and e["data"]["status"] in TERMINAL_STATUSES]
            if len(ends) != 1:
                problems.append(f"job {job_id}: {len(ends)} terminal status events")
        if retried > stops:
            problems.append(f"{retried} retried attempts, but only {stops} worker stop(s) could explain them")
        logger.info("HTTP statuses: %s", dict(requests.statuses))
        problems += requests.violations
    finally:
        tree = service.descendants()
        service.stop()
        wait_gone(tree, timeout=30)
    time.sleep(2)
    if left := shm_buffers() - shm_before:
        problems.append(f"/dev/shm holds {len(left)} new all-reduce buffer(s): {sorted(left)[:5]}")
    if left_processes := tuneq_processes() - processes_before:
        problems.append(f"{len(left_processes)} tuneq process(es) left running: {sorted(left_processes)[:5]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=240)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--submit-every", type=float, default=1.0, help="seconds between submits")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    with tempfile.TemporaryDirectory(prefix="tuneq-soak-") as work:
        problems = run(jobs=args.jobs, steps=args.steps, submit_every=args.submit_every, work=Path(work))
    for problem in problems:
        logger.error("FAILED: %s", problem)
    if problems:
        return 1
    logger.info("soak passed: %d jobs, each run once; no 5xx but 503 + Retry-After; nothing left behind", args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
