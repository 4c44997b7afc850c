"""Starting real ``tuneq`` processes for end-to-end tests, and talking to them over HTTP."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from sqlalchemy import create_engine, text

from cli.samples import seed_config
from shared.jobs.status import TERMINAL_STATUSES
from shared.ports import free_port
from worker.warm_start import ZYGOTE_MODULE


class Tuneq:
    """``tuneq dev``, or ``tuneq serve`` plus ``tuneq worker``, as child processes."""

    def __init__(
        self,
        *,
        home: Path,
        env: dict[str, str] | None = None,
        split: bool = False,
        cwd: Path | None = None,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        """``cwd``: start the processes there through the installed ``tuneq`` command, as a user
        would (by default ``python -m cli.main`` from the tests' own directory). ``worker_env``:
        what the workers of a ``split`` deployment get besides ``env`` (their own TUNEQ_HOME,
        as on another host)."""
        self.home = home
        self.cwd = cwd
        self.port = free_port()
        self.env = {**os.environ, "TUNEQ_HOME": str(home), **(env or {})}
        for var in ("TUNEQ_DATABASE_URL", "TUNEQ_BROKER_URL"):
            if env is None or var not in env:
                self.env.pop(var, None)
        # Queues named after the home: tests sharing the Redis test database cannot take each
        # other's messages (nor can a worker left behind by an aborted run), while a service
        # restarted on the same home still consumes the queue its jobs were published to.
        if env is None or "TUNEQ_QUEUE" not in env:
            self.env["TUNEQ_QUEUE"] = "tuneq-" + hashlib.sha1(str(home.resolve()).encode()).hexdigest()[:10]
        self.split = split
        self.worker_env = worker_env or {}
        self.processes: list[subprocess.Popen[bytes]] = []
        self.log = home / "tuneq-processes.log"
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def _spawn(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as home_log:
            command = [str(Path(sys.executable).with_name("tuneq"))] if self.cwd else [sys.executable, "-m", "cli.main"]
            process = subprocess.Popen(
                [*command, *args],
                cwd=self.cwd,
                env={**self.env, **(env or {})},
                stdout=home_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def migrate(self) -> None:
        """``tuneq migrate``, as a deployment runs it before starting ``serve`` and ``worker``."""
        with self.log.open("ab") as home_log:
            subprocess.run(
                [sys.executable, "-m", "cli.main", "migrate"],
                env=self.env,
                stdout=home_log,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=120,
            )

    def create_key(self, owner: str, *, admin: bool = False) -> str:
        """``tuneq keys create --owner OWNER [--admin]`` against this deployment's database: the key."""
        created = subprocess.run(
            [sys.executable, "-m", "cli.main", "keys", "create", "--owner", owner, *(["--admin"] if admin else [])],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return created.stdout.strip()

    def launch(self, *, workers: int = 1) -> Tuneq:
        """Start the processes without waiting for them to be ready."""
        self.home.mkdir(parents=True, exist_ok=True)
        if not self.env.get("TUNEQ_DATABASE_URL", "sqlite").startswith("sqlite"):
            self.migrate()  # only the embedded default migrates itself
        if self.split:
            self._spawn("serve", "--port", str(self.port))
            for _ in range(workers):
                self.start_worker()
        else:
            self._spawn("dev", "--port", str(self.port))
        return self

    def start(self, *, timeout: float = 120, workers: int = 1, ready: str = "/readyz") -> Tuneq:
        self.launch(workers=workers)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if self.client.get(ready).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tuneq not ready; see {self.log}")

    def start_worker(self, **env: str) -> subprocess.Popen[bytes]:
        """A worker with ``worker_env`` and then ``env`` (a new host's TUNEQ_HOME, say)."""
        return self._spawn("worker", env={**self.worker_env, **env})

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL a process's whole group, as the OOM killer or a host reboot would."""
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self.processes.remove(process)

    def ranks_of(self, job_id: str) -> list[psutil.Process]:
        marker = f"{job_id}/spec.json"
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if any(marker in part for part in p.info["cmdline"] or []):
                found.append(p)
        return found

    def _check_alive(self) -> None:
        for p in self.processes[:1]:  # the API (or dev); tests kill workers on purpose
            if p.poll() is not None:
                raise RuntimeError(f"tuneq process exited with {p.returncode}:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def descendants(self) -> list[psutil.Process]:
        found: list[psutil.Process] = []
        for p in self.processes:
            try:
                parent = psutil.Process(p.pid)
                found += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return found

    def warm_starts(self) -> list[psutil.Process]:
        """The zygotes of this service's workers, wherever they are in the process tree: one
        whose worker is gone has init as its parent."""
        return self.environment_processes(command=ZYGOTE_MODULE)

    def environment_processes(self, *, command: str = "") -> list[psutil.Process]:
        """Every process with this service's environment (its TUNEQ_QUEUE) whose command line
        holds ``command``, wherever it is in the process tree: orphans included."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if command not in " ".join(p.info["cmdline"] or []):
                continue
            with contextlib.suppress(psutil.Error):
                if p.environ().get("TUNEQ_QUEUE") == self.env["TUNEQ_QUEUE"]:
                    found.append(p)
        return found

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post("/jobs", json=body)
        assert response.status_code == 201, response.text
        return dict(response.json())

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.get(f"/jobs/{job_id}"))

    def wait(
        self, job_id: str, *, timeout: float = 600, until: frozenset[str] | set[str] = TERMINAL_STATUSES
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] in until:
                return job
            self._check_alive()
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id)['status']}:\n{self.log_tail()}")

    def get(self, path: str, *, unavailable_for: float = 60) -> Any:
        """GET as a client should: a 503 (the database is away a moment) is retried after its
        Retry-After, for up to ``unavailable_for`` seconds."""
        deadline = time.monotonic() + unavailable_for
        response = self.client.get(path)
        while response.status_code == 503 and time.monotonic() < deadline:
            time.sleep(min(float(response.headers.get("Retry-After", 1)), 1.0))
            response = self.client.get(path)
        return response.raise_for_status().json()

    def stop(self, *, timeout: float = 60) -> None:
        for p in self.processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.client.close()


def job_body(home: Path, dataset: str, **fields: Any) -> dict[str, Any]:
    """A job spec that trains the tiny model of a test module's ``home`` (conftest.py's) on
    ``dataset``: a file under ``home/data``, or a URL; ``fields``: the rest of the spec."""
    location = dataset if "://" in dataset else str(home / "data" / dataset)
    return {"model": str(home / "data" / "tiny-gpt-neo"), "dataset": location, **fields}


def repeated_job_body(home: Path, **fields: Any) -> dict[str, Any]:
    """A short job that learns fast (lr 1e-2 on ``data/repeated.jsonl``, one record repeated, which
    the module writes): its loss falls step after step, so a job continued from another's output
    shows where it started. ``fields``: the rest of the spec, or what replaces these."""
    config = seed_config(fp16=False, train_batch_size=2, lr=1e-2)
    training = {"max_steps": 4, "max_seq_length": 64}
    return job_body(home, "repeated.jsonl", deepspeed_config=config, training=training) | fields


def succeeded_with_losses(tuneq: Tuneq, request: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
    """Submit ``request``, wait for it to succeed, and return the job with its loss at each step."""
    job = tuneq.wait(tuneq.submit(request)["id"], timeout=300)
    assert job["status"] == "succeeded", f"{job['error']}\n{tuneq.log_tail()}"
    return job, [m["loss"] for m in tuneq.get(f"/jobs/{job['id']}/metrics")["data"]]


def all_events(tuneq: Tuneq, job_id: str) -> list[dict[str, Any]]:
    """Every event of the job, page after page (``GET /jobs/{id}/events`` answers 1000 at most)."""
    events: list[dict[str, Any]] = []
    cursor = 0
    while page := tuneq.get(f"/jobs/{job_id}/events?limit=1000&after={cursor}")["data"]:
        events += page
        cursor = page[-1]["id"]
    return events


def wait_until(predicate: Any, *, timeout: float, what: str, tuneq: Tuneq) -> Any:
    """``predicate()``'s first truthy value, polled until ``timeout``; else a TimeoutError
    saying ``what`` did not happen, with the end of the service's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise TimeoutError(f"{what}\n{tuneq.log_tail()}")


def wait_gone(processes: list[psutil.Process], *, timeout: float) -> list[psutil.Process]:
    """The processes still running (not zombies) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = processes
    while time.monotonic() < deadline:
        alive = [p for p in processes if _running(p)]
        if not alive:
            return []
        time.sleep(0.5)
    return alive


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_cluster(
    root: Path, data: Path, *, database: str, broker: str, store: dict[str, str], hosts: int, **env: str
) -> Tuneq:
    """``tuneq serve`` and ``hosts`` workers, each on a home of its own (another "host"), all
    advertising 127.0.0.1; returns once every worker has registered."""
    settings = {
        "TUNEQ_DATABASE_URL": database,
        "TUNEQ_BROKER_URL": broker,
        "TUNEQ_ALLOWED_ROOTS": str(data),
        "TUNEQ_RECONCILE_SECONDS": "1",
        "TUNEQ_WORKER_ADDRESS": "127.0.0.1",
        **store,
        **env,
    }
    tuneq = Tuneq(home=root / "api", env=settings, split=True)
    tuneq.start(workers=0, ready="/healthz")
    for host in range(hosts):
        tuneq.start_worker(TUNEQ_HOME=str(root / f"host-{host}"))
    wait_for_workers(tuneq, database, hosts)
    return tuneq


def wait_for_workers(tuneq: Tuneq, database: str, count: int, *, timeout: float = 120) -> None:
    """Until ``count`` workers that have not stopped are registered (and idle)."""
    engine = create_engine(database)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                query = "SELECT count(*) FROM workers WHERE stopped_at IS NULL AND idle_since IS NOT NULL"
                if conn.execute(text(query)).scalar() == count:
                    return
            time.sleep(0.5)
    finally:
        engine.dispose()
    raise TimeoutError(f"{count} workers never registered\n{tuneq.log_tail()}")
