"""B4: ``GET /jobs/{id}`` on Postgres through ``tuneq serve`` ÷ a bare FastAPI endpoint, 64 clients.

Beside the two, under the same load: the least a FastAPI route can do
(``benchmarks.bare_api:minimal``), for the p99 floor of any FastAPI route on the host; and a
second ``tuneq serve`` with API keys on, as deployed off loopback, where each request looks its
key up in the database. All four servers are real processes run by the same uvicorn settings (``tuneq serve`` runs
uvicorn with ``log_level="info", access_log=False, loop="asyncio"``); the load comes from a separate
process, ``benchmarks.load`` (one raw keep-alive HTTP/1.1 connection per client, timed at the
client), so the load generator shares no GIL with this process and costs the servers as
little of the machine's CPU as it can.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import httpx

from benchmarks.common import (
    REPO,
    Server,
    drop_schema,
    fresh_postgres_schema,
    migrate,
    percentile,
    tuneq_env,
)
from benchmarks.results import Check, Result, Stat
from shared.ports import free_port

CLIENTS = 64
REQUESTS_PER_CLIENT = 40  # 2560 requests a repeat
WARMUP_PER_CLIENT = 5


def _measure(base_url: str, path: str, headers: Sequence[str] = ()) -> tuple[float, float]:
    """Requests per second over the timed burst, and the p99 latency in ms, both from the client."""
    argv = [
        sys.executable,
        "-m",
        "benchmarks.load",
        base_url + path,
        "--clients",
        str(CLIENTS),
        "--requests",
        str(REQUESTS_PER_CLIENT),
        "--warmup",
        str(WARMUP_PER_CLIENT),
        *(arg for header in headers for arg in ("--header", header)),
    ]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed ({done.returncode}): {done.stderr[-2000:]}")
    measured = json.loads(done.stdout)
    return float(measured["rps"]), percentile(measured["latencies"], 99) * 1000


def _check_body(base_url: str, path: str, headers: dict[str, str] | None = None) -> None:
    """The raw client only checks for a 200: once, look at the body, so a broken server shows."""
    body = httpx.get(base_url + path, headers=headers, timeout=30).raise_for_status().json()
    if body.get("step") != 500:
        raise RuntimeError(f"{base_url}{path} answered an unexpected body: {body}")


def _insert_job(database_url: str) -> uuid.UUID:
    from sqlmodel import Session

    from shared.db.engine import make_engine
    from shared.db.models import Job
    from shared.jobs.status import JobStatus

    engine = make_engine(database_url)
    job = Job(
        name="bench",
        status=JobStatus.running,
        model="/srv/models/gpt-neo",
        dataset="/srv/data/train.jsonl",
        deepspeed_config={"train_batch_size": 8, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
        num_gpus=2,
        training={"epochs": 1, "max_steps": 1000},
        step=500,
        total_steps=1000,
        latest_metrics={"step": 500, "loss": 2.5, "learning_rate": 3e-5},
    )
    with Session(engine) as session:
        session.add(job)
        session.commit()
        job_id = job.id
    engine.dispose()
    return job_id


def _uvicorn(app: str, port: int) -> list[str]:
    """A baseline of ``benchmarks.bare_api`` under the uvicorn settings ``tuneq serve`` uses."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        f"benchmarks.bare_api:{app}",
        "--port",
        str(port),
        "--log-level",
        "info",
        "--no-access-log",
        "--loop",
        "asyncio",
    ]


def _create_key(database_url: str, owner: str) -> str:
    from sqlmodel import Session

    from shared.db.api_keys import create_key
    from shared.db.engine import make_engine

    engine = make_engine(database_url)
    with Session(engine) as session:
        key = create_key(session=session, owner=owner)[1]
    engine.dispose()
    return key


def _serve(port: int) -> list[str]:
    return [sys.executable, "-m", "cli.main", "serve", "--port", str(port)]


def run(repeats: int) -> Result:
    database_url = fresh_postgres_schema()
    try:
        with tempfile.TemporaryDirectory(prefix="tuneq-bench-b4-") as tmp:
            home = Path(tmp)
            env = tuneq_env(home=home, database_url=database_url)
            log = home / "servers.log"
            migrate(env, log)
            job_id = _insert_job(database_url)
            path = f"/jobs/{job_id}"
            # The job belongs to "local", the owner of every job with keys off; with keys on it
            # is read with a key of that owner.
            keyed = {"Authorization": f"Bearer {_create_key(database_url, 'local')}"}
            ports = {side: free_port() for side in ("bare", "tuneq", "minimal", "tuneq_keys")}
            # side: (argv, environment, readiness path, headers of every request)
            sides: dict[str, tuple[list[str], dict[str, str], str, dict[str, str]]] = {
                "bare": (_uvicorn("app", ports["bare"]), env, "/healthz", {}),
                "tuneq": (_serve(ports["tuneq"]), env, "/readyz", {}),
                "minimal": (_uvicorn("minimal", ports["minimal"]), env, "/healthz", {}),
                "tuneq_keys": (_serve(ports["tuneq_keys"]), {**env, "TUNEQ_AUTH": "on"}, "/readyz", keyed),
            }
            rps: dict[str, list[float]] = {side: [] for side in sides}
            p99: dict[str, list[float]] = {side: [] for side in sides}
            with ExitStack() as stack:
                servers = {
                    side: stack.enter_context(Server(argv, env=side_env, log=log, port=ports[side]))
                    for side, (argv, side_env, _, _) in sides.items()
                }
                for side, server in servers.items():
                    server.wait_ready(sides[side][2])
                    _check_body(server.base_url, path, sides[side][3])
                for server in servers.values():
                    server.wait_idle()
                for _ in range(repeats):
                    # In turn, so drift on a shared machine falls on every side alike.
                    for side, server in servers.items():
                        headers = [f"{name}: {value}" for name, value in sides[side][3].items()]
                        side_rps, side_p99 = _measure(server.base_url, path, headers)
                        rps[side].append(side_rps)
                        p99[side].append(side_p99)
    finally:
        drop_schema(database_url)
    return Result(
        id="B4",
        title="GET /jobs/{id} rps on Postgres ÷ bare FastAPI, 64 clients",
        checks=[
            Check("rps ratio", Stat.of([t / b for t, b in zip(rps["tuneq"], rps["bare"], strict=True)]), ">=", 0.6),
            Check("p99 latency", Stat.of(p99["tuneq"]), "<=", 20.0, unit=" ms"),
        ],
        details={
            "clients": CLIENTS,
            "requests_per_repeat": CLIENTS * REQUESTS_PER_CLIENT,
            "tuneq_rps": Stat.of(rps["tuneq"]).__dict__,
            "bare_rps": Stat.of(rps["bare"]).__dict__,
            "bare_p99_ms": Stat.of(p99["bare"]).__dict__,
            # The floor: the least a FastAPI route can do on this host under the same load.
            "minimal_rps": Stat.of(rps["minimal"]).__dict__,
            "minimal_p99_ms": Stat.of(p99["minimal"]).__dict__,
            # tuneq with API keys on, as deployed off loopback: each request looks its key up.
            "tuneq_keys_rps": Stat.of(rps["tuneq_keys"]).__dict__,
            "tuneq_keys_p99_ms": Stat.of(p99["tuneq_keys"]).__dict__,
        },
    )
