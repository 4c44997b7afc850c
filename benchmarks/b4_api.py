"""B4: ``GET /jobs/{id}`` on Postgres through ``tuneq serve`` ÷ a bare FastAPI endpoint, 64 clients.

Beside the two, the least a FastAPI route can do (``benchmarks.bare_api:minimal``) runs under the
same load, for the p99 floor of any FastAPI route on the host. All three servers are real
processes run by the same uvicorn settings (``tuneq serve`` runs
``uvicorn.run(..., log_level="info", access_log=False)``); the load comes from a separate
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


def _measure(base_url: str, path: str) -> tuple[float, float]:
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
    ]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed ({done.returncode}): {done.stderr[-2000:]}")
    measured = json.loads(done.stdout)
    return float(measured["rps"]), percentile(measured["latencies"], 99) * 1000


def _check_body(base_url: str, path: str) -> None:
    """The raw client only checks for a 200: once, look at the body, so a broken server shows."""
    body = httpx.get(base_url + path, timeout=30).raise_for_status().json()
    if body.get("step") != 500:
        raise RuntimeError(f"{base_url}{path} answered an unexpected body: {body}")


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
    ]


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
            tuneq_port, bare_port, minimal_port = free_port(), free_port(), free_port()
            serve = [sys.executable, "-m", "shared.cli", "serve", "--port", str(tuneq_port)]
            bare, minimal = (_uvicorn(app, port) for app, port in (("app", bare_port), ("minimal", minimal_port)))
            ratios: list[float] = []
            p99s: list[float] = []
            tuneq_rps: list[float] = []
            bare_rps: list[float] = []
            bare_p99s: list[float] = []
            minimal_rps: list[float] = []
            minimal_p99s: list[float] = []
            with (
                Server(serve, env=env, log=log, port=tuneq_port) as api,
                Server(bare, env=env, log=log, port=bare_port) as baseline,
                Server(minimal, env=env, log=log, port=minimal_port) as floor,
            ):
                api.wait_ready("/readyz")
                baseline.wait_ready("/healthz")
                floor.wait_ready("/healthz")
                for server in (api, baseline, floor):
                    _check_body(server.base_url, path)
                    server.wait_idle()
                for _ in range(repeats):
                    # In turn, so drift on a shared machine falls on every side alike.
                    b_rps, b_p99 = _measure(baseline.base_url, path)
                    t_rps, t_p99 = _measure(api.base_url, path)
                    m_rps, m_p99 = _measure(floor.base_url, path)
                    minimal_rps.append(m_rps)
                    minimal_p99s.append(m_p99)
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
            # The floor: the least a FastAPI route can do on this host under the same load.
            "minimal_rps": Stat.of(minimal_rps).__dict__,
            "minimal_p99_ms": Stat.of(minimal_p99s).__dict__,
        },
    )
