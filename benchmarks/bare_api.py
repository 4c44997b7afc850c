"""B4's baselines, each a job-shaped JSON body with no database.

``app``: the bare FastAPI endpoint users would write (a sync ``def`` returning a dict), the
reference of B4's ratio. ``minimal``: the least a FastAPI route can do (async, no dependency,
no middleware, a body encoded once at import), whose p99 under B4's load is the floor any
FastAPI route has on the host.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Response

app = FastAPI()

_JOB: dict[str, Any] = {
    "id": str(uuid.uuid4()),
    "owner": "local",
    "name": "bench",
    "status": "running",
    "model": "/srv/models/gpt-neo",
    "revision": None,
    "dataset": "/srv/data/train.jsonl",
    "validation_dataset": None,
    "resume_from": None,
    "deepspeed_config": {"train_batch_size": 8, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
    "resolved_deepspeed_config": None,
    "num_gpus": 2,
    "training": {"epochs": 1, "max_steps": 1000},
    "created_at": datetime.now(UTC).isoformat(),
    "started_at": datetime.now(UTC).isoformat(),
    "finished_at": None,
    "step": 500,
    "total_steps": 1000,
    "latest_metrics": {"step": 500, "loss": 2.5, "learning_rate": 3e-5},
    "epoch": 0.5,
    "tokens_seen": 1_000_000,
    "eta_seconds": 60.0,
    "error_code": None,
    "error_message": None,
    "attempts": 1,
    "max_restarts": 2,
}


@app.get("/jobs/{job_id}")
def get_job(job_id: uuid.UUID) -> dict[str, Any]:
    return {**_JOB, "id": str(job_id)}


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


minimal = FastAPI()
_BODY = json.dumps(_JOB).encode()


@minimal.get("/jobs/{job_id}")
async def get_job_minimal(job_id: str) -> Response:
    return Response(_BODY, media_type="application/json")


@minimal.get("/healthz")
async def healthz_minimal() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")
