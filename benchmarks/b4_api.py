"""B4: ``GET /jobs/{id}`` on Postgres through ``tuneq serve`` ÷ a bare FastAPI endpoint, 64 clients.

Both servers are real processes run by the same uvicorn settings (``tuneq serve`` runs
``uvicorn.run(..., log_level="info", access_log=False)``); the load comes from one
``httpx.AsyncClient`` per client, all in this process.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from benchmarks.common import (
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


async def _load(base_url: str, path: str, *, clients: int, per_client: int) -> tuple[float, list[float]]:
    """Requests per second over the whole burst, and every request's latency in seconds."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as c:
            for _ in range(per_client):
                started = time.perf_counter()
                response = await c.get(path)
                latencies.append(time.perf_counter() - started)
                response.raise_for_status()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    return clients * per_client / elapsed, latencies


def _measure(base_url: str, path: str) -> tuple[float, float]:
    asyncio.run(_load(base_url, path, clients=CLIENTS, per_client=WARMUP_PER_CLIENT))
    rps, latencies = asyncio.run(_load(base_url, path, clients=CLIENTS, per_client=REQUESTS_PER_CLIENT))
    return rps, percentile(latencies, 99) * 1000


def _insert_job(database_url: str) -> uuid.UUID:
    from sqlmodel import Session

    from shared.db import make_engine
    from shared.models import Job, JobStatus

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
            tuneq_port, bare_port = free_port(), free_port()
            serve = [sys.executable, "-m", "shared.cli", "serve", "--port", str(tuneq_port)]
            bare = [
                sys.executable,
                "-m",
                "uvicorn",
                "benchmarks.bare_api:app",
                "--port",
                str(bare_port),
                "--log-level",
                "info",
                "--no-access-log",
            ]
            ratios: list[float] = []
            p99s: list[float] = []
            tuneq_rps: list[float] = []
            bare_rps: list[float] = []
            bare_p99s: list[float] = []
            with (
                Server(serve, env=env, log=log, port=tuneq_port) as api,
                Server(bare, env=env, log=log, port=bare_port) as baseline,
            ):
                api.wait_ready("/readyz")
                baseline.wait_ready("/healthz")
                for _ in range(repeats):
                    # Alternate, so drift on a shared machine falls on both sides alike.
                    b_rps, b_p99 = _measure(baseline.base_url, path)
                    t_rps, t_p99 = _measure(api.base_url, path)
                    ratios.append(t_rps / b_rps)
                    p99s.append(t_p99)
                    tuneq_rps.append(t_rps)
                    bare_rps.append(b_rps)
                    bare_p99s.append(b_p99)
    finally:
        drop_schema(database_url)
    return Result(
        id="B4",
        title="GET /jobs/{id} rps on Postgres ÷ bare FastAPI, 64 clients",
        checks=[
            Check("rps ratio", Stat.of(ratios), ">=", 0.6),
            Check("p99 latency", Stat.of(p99s), "<=", 20.0, unit=" ms"),
        ],
        details={
            "clients": CLIENTS,
            "requests_per_repeat": CLIENTS * REQUESTS_PER_CLIENT,
            "tuneq_rps": Stat.of(tuneq_rps).__dict__,
            "bare_rps": Stat.of(bare_rps).__dict__,
            "bare_p99_ms": Stat.of(bare_p99s).__dict__,
        },
    )
