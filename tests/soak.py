"""``make soak``: an operator's bad week in a quarter of an hour, on real processes.

A few hundred tiny jobs go through ``tuneq serve`` and two ``tuneq worker`` processes on
Postgres and Redis, each worker with a home of its own (as on two hosts) and one store, while:

- Postgres is restarted, and Redis is restarted (losing what it held: it runs without
  persistence here);
- the disk of one worker (a tmpfs) fills up mid-run, and is freed again later;
- workers are stopped (SIGTERM, as ``docker stop`` sends it) at random instants and replaced;
- hostile dataset records and uploads are sent (nested thousands deep, lone surrogates, NULs,
  a line past the line limit, NULs in paths);
- bursts of concurrent reads hit the API.

The run passes when:

- every job succeeded exactly once: one ``succeeded`` status event, every step's metrics
  once, and an attempt more only for a stop that handed it back or a disk that filled under it
  (never counted against max_restarts: none failed for a cause outside the job);
- every hostile request got a 4xx and left no job behind;
- no valid request got a 5xx other than a ``503`` with ``Retry-After`` (what the API answers
  while its database is away, and what clients retry), and no connection was dropped;
- ``/dev/shm``, the mounts and the process table are as they were at the start.

Not part of ``make test``: it restarts this machine's Postgres cluster and Redis server, and
mounts a tmpfs (as root). Run it on a machine where nothing else uses them (``.ci/run`` starts
both the same way).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
MB = 1024**2
SMALL_DISK_MB = 96
# Left free when the small disk "fills": under a tiny job's final checkpoint and export, over
# the worker's own floor (TUNEQ_MIN_FREE_DISK_MB below), so a job it runs meets a full disk.
LEFT_FREE_KB = 1536
MIN_FREE_DISK_MB = 1
MAX_LINE_BYTES = 64 * 1024
READ_BURST = 200  # concurrent GET /jobs/{id} per burst


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
                self.violation(f"{method} {path}: {type(e).__name__}: {e}")
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
                self.violation(f"{method} {path}: {response.status_code} {response.text[:200]}")
            return response

    def violation(self, what: str) -> None:
        logger.error("violation: %s", what)
        with self._lock:
            self.violations.append(what)


def tuneq_processes(work: Path) -> set[tuple[int, float]]:
    """The tuneq processes of this soak: a TUNEQ_HOME under ``work`` in their environment, which
    ranks, warm starts and pool processes inherit (orphans included); not the processes of
    anything else the machine runs meanwhile."""
    found = set()
    for process in psutil.process_iter(["cmdline", "create_time"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if process.pid == os.getpid() or not any(marker in cmdline for marker in TUNEQ_PROCESS_MARKERS):
            continue
        with contextlib.suppress(psutil.Error):
            if process.environ().get("TUNEQ_HOME", "").startswith(str(work)):
                found.add((process.pid, process.info["create_time"]))
    return found


def shm_buffers() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{BUFFER_PREFIX}_{os.getuid()}_*")}


def mounts() -> set[str]:
    return {p.mountpoint for p in psutil.disk_partitions(all=True)}


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


def job_body(data: Path, steps: int, dataset: str = "train.jsonl") -> dict[str, Any]:
    return {
        "model": str(data / "tiny-gpt-neo"),
        "dataset": str(data / dataset),
        "deepspeed_config": seed_config(fp16=False),
        "training": {"max_steps": steps, "epochs": 100, "max_seq_length": 32, "checkpoint_every_steps": 1},
    }


def nested(levels: int) -> str:
    """JSON text nested ``levels`` deep (written out: json.dumps itself recurses per level)."""
    return "[" * levels + '"x"' + "]" * levels


HOSTILE_RECORDS: dict[str, str] = {
    "nested 5000 deep": '{"text": "a", "extra": ' + nested(5000) + "}",
    "a lone surrogate": '{"text": "hello \\ud800 there"}',
    "a NUL": '{"text": "hello \\u0000 there"}',
    "a line past the limit": json.dumps({"text": "x" * (MAX_LINE_BYTES + 10)}),
}
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
HOSTILE_UPLOADS: dict[str, str] = {
    "nested 5000 deep": json.dumps(CHAT)[:-1] + ', "tools": ' + nested(5000) + "}",
    "a lone surrogate": json.dumps(CHAT).replace("hello", "h\\ud800i"),
    "a line past the limit": json.dumps({**CHAT, "metadata": "x" * (MAX_LINE_BYTES + 10)}),
}


class SmallDisk:
    """A worker's disk: a tmpfs that fills up (a ballast file) and is freed again."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.ballast = mount / "ballast"

    def __enter__(self) -> SmallDisk:
        self.mount.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_MB}M", "tmpfs", str(self.mount)], check=True)
        return self

    def __exit__(self, *_exc: object) -> None:
        subprocess.run(["umount", "-l", str(self.mount)], check=False)

    def fill(self) -> None:
        """Leave LEFT_FREE_KB free, in pieces: the worker's job writes to the disk meanwhile."""
        piece = 256 * 1024
        with self.ballast.open("ab") as f:
            while self.free_bytes() - piece > LEFT_FREE_KB * 1024:
                try:
                    f.write(b"\0" * piece)
                    f.flush()
                except OSError:  # the job took the rest first: full is full
                    break

    def free_bytes(self) -> int:
        stat = os.statvfs(self.mount)
        return stat.f_bavail * stat.f_frsize

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)


class Soak:
    """One soak run: the deployment, the jobs, the faults, and what went wrong."""

    def __init__(self, *, jobs: int, steps: int, submit_every: float, work: Path, seed: int) -> None:
        self.jobs, self.steps, self.submit_every, self.work = jobs, steps, submit_every, work
        self.random = random.Random(seed)
        self.data = work / "home" / "data"
        self.problems: list[str] = []
        self.submitted: list[str] = []
        self.stops = 0
        self.disk = SmallDisk(work / "small-disk")

    def start(self) -> Tuneq:
        """``tuneq serve`` and two workers: worker A on an ordinary disk, worker B on the small one."""
        build_tiny_model(self.data / "tiny-gpt-neo")
        write_text_dataset(self.data / "train.jsonl", records=32)
        for name, line in HOSTILE_RECORDS.items():
            path = self.data / f"hostile-{name.replace(' ', '-')}.jsonl"
            path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
        import redis

        redis.Redis.from_url(REDIS_URL).flushdb()
        env = {
            "TUNEQ_DATABASE_URL": fresh_postgres_schema(POSTGRES_URL, prefix="soak"),
            "TUNEQ_BROKER_URL": REDIS_URL,
            "TUNEQ_ARTIFACTS_URI": str(self.work / "store"),  # one store for both hosts, as S3 would be
            "TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER": "0",
            "TUNEQ_RECONCILE_SECONDS": "2",
            "TUNEQ_REPUBLISH_AFTER_SECONDS": "10",
            "TUNEQ_LEASE_TTL_SECONDS": "30",
            "TUNEQ_MIN_FREE_DISK_MB": str(MIN_FREE_DISK_MB),
            "TUNEQ_MAX_LINE_BYTES": str(MAX_LINE_BYTES),
        }
        service = Tuneq(home=self.work / "home", env=env, split=True).start(workers=0)
        self.homes: dict[int, str] = {}  # worker pid -> its TUNEQ_HOME
        for home in (self.work / "worker-a", self.disk.mount / "home"):
            self.homes[service.start_worker(TUNEQ_HOME=str(home)).pid] = str(home)
        return service

    def run(self) -> list[str]:
        """The soak; the list of what went wrong (empty: it passed)."""
        shm_before, processes_before, mounts_before = shm_buffers(), tuneq_processes(self.work), mounts()
        with self.disk:
            service = self.start()
            self.requests = Requests(service.client)
            try:
                self.drive(service)
                self.check_jobs()
                logger.info("HTTP statuses: %s", dict(self.requests.statuses))
                self.problems += self.requests.violations
            finally:
                tree = service.descendants()
                service.stop()
                wait_gone(tree, timeout=30)
        time.sleep(2)
        if left := shm_buffers() - shm_before:
            self.problems.append(f"/dev/shm holds {len(left)} new all-reduce buffer(s): {sorted(left)[:5]}")
        if left_processes := tuneq_processes(self.work) - processes_before:
            self.problems.append(f"{len(left_processes)} tuneq process(es) left running: {sorted(left_processes)[:5]}")
        if left_mounts := mounts() - mounts_before:
            self.problems.append(f"mounts left: {sorted(left_mounts)}")
        return self.problems

    def faults(self, service: Tuneq) -> list[tuple[float, str, Callable[[], None]]]:
        """What happens when, by the share of the jobs ended."""
        stop = ("stop a worker at a random instant", lambda: self.stop_worker(service))
        burst = ("a burst of concurrent reads", self.read_burst)
        return [
            (0.10, "fill worker B's disk", self.disk.fill),
            (0.20, "restart Postgres", restart_postgres),
            (0.25, "hostile records and uploads", self.hostile_requests),
            (0.35, "free worker B's disk", self.disk.free),
            (0.45, "restart Redis", restart_redis),
            (0.50, *burst),
            (0.55, *stop),
            (0.65, *stop),
            (0.70, *burst),
            (0.75, *stop),
            (0.85, *stop),
        ]

    def drive(self, service: Tuneq) -> None:
        """Submit the jobs while the faults happen; return once every job has ended."""
        submitter = threading.Thread(target=self.submit_all, name="submitter", daemon=True)
        submitter.start()
        faults = self.faults(service)
        started = time.monotonic()
        while True:
            listed = self.requests.call("GET", "/jobs", params={"limit": 500}).json()["data"]
            done = sum(1 for j in listed if j["status"] in TERMINAL_STATUSES)
            while faults and done >= faults[0][0] * self.jobs:
                _, what, act = faults.pop(0)
                logger.info("%d/%d jobs done: %s", done, self.jobs, what)
                act()
            if not submitter.is_alive() and done >= len(self.submitted) == self.jobs:
                break
            if time.monotonic() - started > 25 * 60:
                self.problems.append(f"only {done} of {self.jobs} jobs ended within 25 minutes")
                break
            time.sleep(2)
        logger.info("all %d jobs ended in %.0fs; checking them", self.jobs, time.monotonic() - started)

    def submit_all(self) -> None:
        for n in range(self.jobs):
            key = {"Idempotency-Key": f"soak-{n}-{uuid.uuid4().hex[:8]}"}
            response = self.requests.call("POST", "/jobs", json=job_body(self.data, self.steps), headers=key)
            if response.status_code in (200, 201):
                self.submitted.append(response.json()["id"])
            else:
                self.problems.append(f"submit {n}: {response.status_code} {response.text[:200]}")
            time.sleep(self.submit_every)

    def stop_worker(self, service: Tuneq) -> None:
        """SIGTERM a worker, one running a job where there is one, at a random instant (a job
        lasts seconds), and start another on its home."""
        running = self.requests.call("GET", "/jobs", params={"status": "running", "limit": 50}).json()["data"]
        busy = {int(str(j["worker_id"]).rpartition(":")[2]) for j in running if j.get("worker_id")}
        workers = service.processes[1:]
        time.sleep(self.random.uniform(0, 1.5))
        worker = self.random.choice([w for w in workers if w.pid in busy] or workers)
        worker.terminate()  # SIGTERM to the worker's main process, as `docker stop` sends
        worker.wait(timeout=120)
        service.processes.remove(worker)
        home = self.homes.pop(worker.pid)
        self.homes[service.start_worker(TUNEQ_HOME=home).pid] = home
        self.stops += 1

    def hostile_requests(self) -> None:
        """Each hostile record as a dataset (submit and plan) and as an upload, and a NUL in a
        path: a 4xx every time, and no job made."""
        for name in HOSTILE_RECORDS:
            body = job_body(self.data, self.steps, dataset=f"hostile-{name.replace(' ', '-')}.jsonl")
            for path in ("/jobs", "/jobs/plan"):
                self.expect_refused(f"POST {path} with {name}", self.requests.call("POST", path, json=body))
        for name, line in HOSTILE_UPLOADS.items():
            files = {"file": ("hostile.jsonl", (json.dumps(CHAT) + "\n" + line + "\n").encode(), "application/jsonl")}
            response = self.requests.call("POST", "/v1/files", data={"purpose": "fine-tune"}, files=files)
            self.expect_refused(f"POST /v1/files with {name}", response)
        if self.submitted:
            response = self.requests.call("GET", f"/jobs/{self.submitted[0]}/artifacts/model/model.safetensors%00")
            self.expect_refused("a NUL in an artifact path", response)

    def expect_refused(self, what: str, response: httpx.Response) -> None:
        if not 400 <= response.status_code < 500:
            self.problems.append(f"{what}: {response.status_code}, not a 4xx: {response.text[:200]}")

    def read_burst(self) -> None:
        """READ_BURST concurrent GET /jobs/{id}, each on its own connection."""
        ids = self.submitted[-20:] or []
        if not ids:
            return

        def read(n: int) -> int:
            with httpx.Client(base_url=str(self.requests.client.base_url), timeout=60) as client:
                return Requests(client).call("GET", f"/jobs/{ids[n % len(ids)]}").status_code

        with ThreadPoolExecutor(max_workers=READ_BURST) as pool:
            statuses = collections.Counter(pool.map(read, range(READ_BURST)))
        logger.info("burst of %d reads: %s", READ_BURST, dict(statuses))
        if set(statuses) != {200}:
            self.problems.append(f"a burst of reads answered {dict(statuses)}")

    def check_jobs(self) -> None:
        """Every job succeeded once, every step once; an attempt more only where a stop handed
        it back or a disk filled under it. No job but the submitted ones."""
        listed = self.requests.call("GET", "/jobs", params={"limit": 500}).json()
        if listed["count"] != len(self.submitted):
            self.problems.append(f"{listed['count']} jobs listed, {len(self.submitted)} submitted")
        handbacks = disk_retries = 0
        for job_id in self.submitted:
            job = self.requests.call("GET", f"/jobs/{job_id}").json()
            if job["status"] != "succeeded":
                self.problems.append(f"job {job_id} {job['status']}: {job['error']}")
                continue
            steps_seen = [m["step"] for m in self.requests.call("GET", f"/jobs/{job_id}/metrics").json()["data"]]
            if steps_seen != list(range(1, self.steps + 1)):
                self.problems.append(f"job {job_id}: steps {steps_seen}")
            events = self.requests.call("GET", f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
            ends = [e for e in events if e["type"] == "status" and e["data"]["status"] in TERMINAL_STATUSES]
            if len(ends) != 1:
                self.problems.append(f"job {job_id}: {len(ends)} terminal status events")
            disk = sum(1 for e in events if e["type"] == "warning" and _full_disk(str(e["data"].get("message", ""))))
            if job["attempts"] - 1 != job["handbacks"] + disk:
                self.problems.append(
                    f"job {job_id}: {job['attempts']} attempts, {job['handbacks']} handed back, {disk} full disks"
                )
            handbacks, disk_retries = handbacks + job["handbacks"], disk_retries + disk
        logger.info(
            "%d worker stops handed back %d attempts; %d attempts met worker B's full disk",
            self.stops,
            handbacks,
            disk_retries,
        )
        if disk_retries == 0:
            self.problems.append("no job met the full disk: the soak did not test it")


def _full_disk(message: str) -> bool:
    """A requeue's reason that names the worker's full disk (mid-run, or while preparing)."""
    return "disk filled up" in message or "disk is full" in message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=240)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--submit-every", type=float, default=1.0, help="seconds between submits")
    parser.add_argument("--seed", type=int, default=0, help="seeds the instants and the workers stopped")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    with tempfile.TemporaryDirectory(prefix="tuneq-soak-") as work:
        soak = Soak(jobs=args.jobs, steps=args.steps, submit_every=args.submit_every, work=Path(work), seed=args.seed)
        problems = soak.run()
    for problem in problems:
        logger.error("FAILED: %s", problem)
    if problems:
        return 1
    logger.info(
        "soak passed: %d jobs, each run once; no 5xx but 503 + Retry-After; hostile input refused; nothing left behind",
        args.jobs,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
