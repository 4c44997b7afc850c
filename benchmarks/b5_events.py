"""B5: metric events through the worker's real ingest path, and SSE latency with 200 subscribers.

Ingestion: rank 0's ``events-<attempt>.jsonl`` is written ahead (``EVENTS`` metric lines), then
``worker.ingest.EventIngestor.poll`` (the worker's own code: one transaction a poll, the
``job_metrics`` and ``job_events`` rows, the Redis wake-up after commit) drains it into Postgres.

Latency: ``SUBSCRIBERS`` clients follow ``GET /jobs/{id}/events/stream`` on a real ``tuneq serve``
(Postgres, Redis wake-ups); metric lines stamped with the time they are written go through the
same ingest path, and each subscriber records arrival time minus that stamp (same host clock).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    REDIS_URL,
    Server,
    drop_schema,
    fresh_postgres_schema,
    keep_log,
    metric_line,
    migrate,
    percentile,
    tuneq_env,
)
from benchmarks.results import Check, Result, Stat
from shared.ports import free_port

EVENTS = 20_000
SUBSCRIBERS = int(os.environ.get("TUNEQ_BENCH_SSE_SUBSCRIBERS", "200"))
LATENCY_BATCHES = 20  # written 0.1 s apart
EVENTS_PER_BATCH = 5


def _use_settings(env: dict[str, str]) -> None:
    """Point this process's tuneq settings at the benchmark's database and Redis."""
    for key in ("TUNEQ_HOME", "TUNEQ_DATABASE_URL", "TUNEQ_BROKER_URL"):
        os.environ[key] = env[key]
    from shared.settings import get_settings

    get_settings.cache_clear()


def _insert_job(engine: Any) -> uuid.UUID:
    from sqlmodel import Session

    from shared.db.models import Job
    from shared.jobs.status import JobStatus

    job = Job(
        name="bench-events",
        status=JobStatus.running,
        model="/srv/models/gpt-neo",
        dataset="/srv/data/train.jsonl",
        deepspeed_config={"train_batch_size": 8},
        num_gpus=2,
        training={"epochs": 1},
    )
    with Session(engine) as session:
        session.add(job)
        session.commit()
        return job.id


def _ingest_rate(engine: Any, home: Path) -> float:
    from sqlmodel import Session

    from worker.ingest import EventIngestor

    job_id = _insert_job(engine)
    events_path = home / f"events-{job_id}.jsonl"
    events_path.write_text("".join(metric_line(step, steps=EVENTS) + "\n" for step in range(1, EVENTS + 1)))
    ingestor = EventIngestor(events_path=events_path, log_path=None, job_id=job_id)
    done = 0
    started = time.perf_counter()
    while done < EVENTS:
        with Session(engine) as session:
            done += ingestor.poll(session)
    return EVENTS / (time.perf_counter() - started)


async def _subscriber(
    client: httpx.AsyncClient, path: str, expected: int, ready: asyncio.Event, latencies: list[float]
) -> None:
    async with client.stream("GET", path, headers={"accept": "text/event-stream"}) as response:
        response.raise_for_status()
        ready.set()
        seen = 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = json.loads(line[5:])
            if payload.get("type") != "metric":
                continue
            stamped = datetime.fromisoformat(payload["data"]["time"])
            latencies.append((datetime.now(UTC) - stamped).total_seconds())
            seen += 1
            if seen >= expected:
                return


async def _latency_run(base_url: str, engine: Any, home: Path) -> list[float]:
    from sqlmodel import Session

    from worker.ingest import EventIngestor

    job_id = _insert_job(engine)
    path = f"/jobs/{job_id}/events/stream"
    events_path = home / f"events-{job_id}.jsonl"
    events_path.touch()
    ingestor = EventIngestor(events_path=events_path, log_path=None, job_id=job_id)
    expected = LATENCY_BATCHES * EVENTS_PER_BATCH
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=SUBSCRIBERS + 8, max_keepalive_connections=SUBSCRIBERS + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        readies = [asyncio.Event() for _ in range(SUBSCRIBERS)]
        tasks = [asyncio.create_task(_subscriber(client, path, expected, ready, latencies)) for ready in readies]
        try:
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), timeout=120)
            await asyncio.sleep(1.0)  # every stream past its first read, subscribed to the wake-ups
            step = 0
            for _ in range(LATENCY_BATCHES):
                with events_path.open("a") as f:
                    for _ in range(EVENTS_PER_BATCH):
                        step += 1
                        f.write(metric_line(step, steps=EVENTS) + "\n")
                with Session(engine) as session:
                    await asyncio.to_thread(ingestor.poll, session)
                await asyncio.sleep(0.1)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
        except TimeoutError:
            failed = sum(1 for t in tasks if t.done() and t.exception() is not None)
            connected = sum(1 for r in readies if r.is_set())
            raise TimeoutError(
                f"{connected} of {SUBSCRIBERS} streams connected, {failed} failed (see the server log)"
            ) from None
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return latencies


def run(repeats: int) -> list[Result]:
    from shared.db.engine import make_engine

    database_url = fresh_postgres_schema()
    try:
        with tempfile.TemporaryDirectory(prefix="tuneq-bench-b5-") as tmp:
            home = Path(tmp)
            env = tuneq_env(home=home, database_url=database_url, broker_url=REDIS_URL)
            log = home / "servers.log"
            migrate(env, log)
            _use_settings(env)
            engine = make_engine(database_url)
            rates = [_ingest_rate(engine, home) for _ in range(repeats)]
            port = free_port()
            p99s: list[float] = []
            p50s: list[float] = []
            sse_error: str | None = None
            with Server(
                [sys.executable, "-m", "cli.main", "serve", "--port", str(port)], env=env, log=log, port=port
            ) as api:
                api.wait_ready("/readyz")
                try:
                    for _ in range(repeats):
                        latencies = asyncio.run(_latency_run(api.base_url, engine, home))
                        p99s.append(percentile(latencies, 99) * 1000)
                        p50s.append(percentile(latencies, 50) * 1000)
                except Exception as e:  # keep the ingest figure; say why the latency one is missing
                    kept = keep_log(log, "b5")
                    sse_error = f"SSE with {SUBSCRIBERS} subscribers: {type(e).__name__}: {e} (server log: {kept})"
            engine.dispose()
    finally:
        drop_schema(database_url)
    return [
        Result(
            id="B5",
            title="metric events ingested /s (worker path, Postgres); SSE latency, 200 subscribers",
            checks=[
                Check("ingest rate", Stat.of(rates), ">=", 20_000.0, unit=" /s"),
                *([Check("SSE p99 latency", Stat.of(p99s), "<=", 200.0, unit=" ms")] if p99s else []),
            ],
            error=sse_error,
            details={
                "events_per_repeat": EVENTS,
                "subscribers": SUBSCRIBERS,
                "latency_events_per_repeat": LATENCY_BATCHES * EVENTS_PER_BATCH,
                "sse_p50_ms": Stat.of(p50s).__dict__ if p50s else None,
            },
        )
    ]
