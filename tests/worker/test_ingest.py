from __future__ import annotations

import json
from pathlib import Path

from sqlmodel import Session, select

from shared.db import get_engine
from shared.models import Checkpoint, Job, JobMetric
from worker.ingest import EventIngestor

from .test_lifecycle import new_job


def metric(step: int, loss: float) -> str:
    return json.dumps({"type": "metric", "step": step, "loss": loss, "time": "2026-01-01T00:00:00+00:00"})


def test_events_become_rows_each_step_once(database_url: str, tmp_path: Path) -> None:
    job = new_job()
    events = tmp_path / "events.jsonl"
    ingestor = EventIngestor(path=events, job_id=job.id)
    with Session(get_engine()) as session:
        assert ingestor.poll(session) == 0  # no file yet
        plan = {"type": "plan", "total_steps": 3, "steps_per_epoch": 3, "num_samples": 6, "world_size": 1}
        events.write_text(json.dumps(plan) + "\n" + metric(1, 2.0) + "\n" + metric(2, 1.5)[:20])
        assert ingestor.poll(session) == 2  # the half-written line waits
        with events.open("a") as f:
            f.write(metric(2, 1.5)[20:] + "\n" + metric(2, 1.4) + "\nnot json\n")
            ckpt = {
                "type": "checkpoint",
                "step": 2,
                "kind": "deepspeed",
                "uri": "/x",
                "bytes": 10,
                "time": "2026-01-01T00:00:01+00:00",
            }
            f.write(json.dumps(ckpt) + "\n")
        assert ingestor.poll(session) == 3
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id).order_by(JobMetric.step)).all()
        assert [(r.step, r.loss) for r in rows] == [(1, 2.0), (2, 1.4)]
        stored = session.get(Job, job.id, populate_existing=True)
        assert stored is not None and stored.total_steps == 3 and stored.step == 2
        assert stored.latest_metrics is not None and stored.latest_metrics["loss"] == 1.4
        checkpoints = session.exec(select(Checkpoint)).all()
        assert [(c.step, c.kind, c.bytes) for c in checkpoints] == [(2, "deepspeed", 10)]
        # A later attempt reporting step 2 again replaces it.
        with events.open("a") as f:
            f.write(metric(2, 1.2) + "\n")
        ingestor.poll(session)
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id).order_by(JobMetric.step)).all()
        assert [(r.step, r.loss) for r in rows] == [(1, 2.0), (2, 1.2)]
