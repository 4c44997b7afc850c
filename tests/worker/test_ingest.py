from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

from shared.db.engine import get_engine
from shared.db.models import Checkpoint, Job, JobEvent, JobMetric
from shared.jobs.events import CheckpointEvent, MetricEvent
from tests.shared.db.test_lifecycle import new_job
from worker.ingest import EventIngestor


def metric(step: int, loss: float, second: int = 0) -> str:
    return json.dumps(
        {
            "type": "metric",
            "step": step,
            "loss": loss,
            "tokens_seen": step * 10,
            "time": f"2026-01-01T00:00:{second:02d}+00:00",
        }
    )


def test_events_become_rows_each_step_once(database_url: str, tmp_path: Path) -> None:
    job = new_job()
    events, log = tmp_path / "events-1.jsonl", tmp_path / "train.log"
    log.write_text("ingested by an earlier attempt\n")
    completed: list[int] = []  # the checkpoints handed to the publisher

    def on_checkpoint(event: CheckpointEvent) -> None:
        stored = session.get(Job, job.id, populate_existing=True)
        assert stored is not None and stored.step == 2  # the poll that read it has committed
        completed.append(event.step)

    ingestor = EventIngestor(
        events_path=events, log_path=log, job_id=job.id, log_offset=log.stat().st_size, on_checkpoint=on_checkpoint
    )
    with Session(get_engine()) as session:
        assert ingestor.poll(session) == 0  # no file yet
        plan = {"type": "plan", "total_steps": 5, "steps_per_epoch": 5, "num_samples": 6, "world_size": 1}
        events.write_text(json.dumps(plan) + "\n" + metric(1, 2.0, 0) + "\n" + metric(2, 1.5)[:20])
        with log.open("a") as f:
            f.write("loading\rloaded 100%\nhalf a li")
        assert ingestor.poll(session) == 2  # the half-written line waits
        with events.open("a") as f:
            f.write(metric(2, 1.5, 2)[20:] + "\n" + metric(2, 1.4, 2) + "\nnot json\n")
            ckpt = {
                "type": "checkpoint",
                "step": 2,
                "kind": "deepspeed",
                "uri": "/x",
                "bytes": 10,
                "time": "2026-01-01T00:00:01+00:00",
            }
            f.write(json.dumps(ckpt) + "\n")
        with log.open("a") as f:
            f.write("ne\n")
        assert ingestor.poll(session) == 3
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id).order_by(col(JobMetric.step))).all()
        assert [(r.step, r.loss) for r in rows] == [(1, 2.0), (2, 1.4)]
        stored = session.get(Job, job.id, populate_existing=True)
        assert stored is not None and stored.total_steps == 5 and stored.step == 2 and stored.tokens_seen == 20
        assert stored.latest_metrics is not None and stored.latest_metrics["loss"] == 1.4
        assert stored.eta_seconds == 6.0  # 2 s per step since this attempt's first metric, 3 steps left
        # A completed checkpoint is the publisher's: it counts once it is in the artifact store.
        assert completed == [2] and session.exec(select(Checkpoint)).all() == []
        # A later attempt reporting step 2 again replaces it.
        with events.open("a") as f:
            f.write(metric(2, 1.2) + "\n")
        ingestor.poll(session)
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id).order_by(col(JobMetric.step))).all()
        assert [(r.step, r.loss) for r in rows] == [(1, 2.0), (2, 1.2)]
        stream = session.exec(select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id))).all()
    kinds = [(e.type, e.data.get("step", e.data.get("line", e.data.get("total_steps")))) for e in stream]
    assert kinds == [
        ("log", "loaded 100%"),
        ("plan", 5),
        ("metric", 1),
        ("log", "half a line"),
        ("metric", 2),  # the stream shows what was reported; /metrics keeps the last report per step
        ("metric", 2),
        ("metric", 2),
    ]
    assert [e.id for e in stream] == sorted(e.id for e in stream)


def test_offsets_are_committed_with_the_rows_and_leftovers_replay_up_to_a_step(
    database_url: str, tmp_path: Path
) -> None:
    job = new_job()
    events = tmp_path / "events-1.jsonl"
    events.write_text(metric(1, 3.0) + "\n" + metric(2, 2.9) + "\n" + metric(3, 2.8)[:10])
    with Session(get_engine()) as session:
        EventIngestor(events_path=events, log_path=None, job_id=job.id).poll(session)
        stored = session.get(Job, job.id, populate_existing=True)
        assert stored is not None and stored.events_offset == len(metric(1, 3.0) + metric(2, 2.9)) + 2
        # The worker died here; the file grew on. The next attempt resumes from step 3.
        with events.open("a") as f:
            f.write(metric(3, 2.8)[10:] + "\n" + metric(4, 2.7) + "\n")
        leftovers = EventIngestor(
            events_path=events, log_path=None, job_id=job.id, events_offset=stored.events_offset, up_to_step=3
        )
        leftovers.poll(session)
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id).order_by(col(JobMetric.step))).all()
    assert [r.step for r in rows] == [1, 2, 3]  # step 4 is superseded: the next attempt trains it again


# What the worker's processes import: no more (an API import would hide a missing one).
WORKER_RECORDS_A_METRIC = """
import sys, uuid
from pathlib import Path
from sqlmodel import Session
from shared.db.engine import get_engine
from shared.jobs.events import CheckpointEvent, MetricEvent
from worker.ingest import EventIngestor
assert "api" not in sys.modules
job_id, events = uuid.UUID(sys.argv[1]), Path(sys.argv[2])
events.write_text(sys.argv[3] + "\\n")
with Session(get_engine()) as session:
    assert EventIngestor(events_path=events, log_path=events.with_suffix(".log"), job_id=job_id).poll(session) == 1
"""


def test_the_worker_wakes_event_streams_through_redis(
    database_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from shared.db.job_events import channel

    job = new_job()
    subscriber = redis.Redis.from_url(redis_url).pubsub()
    subscriber.subscribe(channel(job.id))
    assert subscriber.get_message(timeout=5)["type"] == "subscribe"
    env = {**os.environ, "TUNEQ_BROKER_URL": redis_url}
    subprocess.run(
        [sys.executable, "-c", WORKER_RECORDS_A_METRIC, str(job.id), str(tmp_path / "events.jsonl"), metric(1, 2.0)],
        env=env,
        check=True,
        timeout=120,
    )
    message = subscriber.get_message(timeout=10)
    assert message is not None and message["type"] == "message", "the worker published no wake-up"


def test_a_large_backlog_is_one_poll_with_every_row_in_order(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.ingest

    monkeypatch.setattr(worker.ingest, "MAX_BIND_PARAMS", 100)  # replaced steps go in several DELETEs
    job = new_job()
    events, log = tmp_path / "events-1.jsonl", tmp_path / "train.log"
    events.write_text("".join(metric(step, 1.0 / step) + "\n" for step in range(1, 3001)))
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    ingestor = EventIngestor(events_path=events, log_path=log, job_id=job.id)

    def stored() -> list[tuple[int, float | None]]:
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id).order_by(col(JobMetric.step))).all()
        return [(r.step, r.loss) for r in rows]

    with Session(get_engine()) as session:
        assert ingestor.poll(session) == 3000
        assert stored() == [(step, 1.0 / step) for step in range(1, 3001)]
        # A resumed attempt reports steps 2001-3500: the overlap replaces the rows, the rest adds.
        with events.open("a") as f:
            f.write("".join(metric(step, 0.5) + "\n" for step in range(2001, 3501)))
        assert ingestor.poll(session) == 1500
        assert stored() == [(step, 1.0 / step if step <= 2000 else 0.5) for step in range(1, 3501)]
        stream = session.exec(select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id))).all()
        job_row = session.get(Job, job.id, populate_existing=True)
    assert [e.data["line"] for e in stream[:10]] == [f"line {i}" for i in range(10)]
    steps = [*range(1, 3001), *range(2001, 3501)]
    assert [(e.type, e.data["step"]) for e in stream[10:]] == [("metric", step) for step in steps]
    assert all(e.created_at is not None for e in stream)
    assert stream[-1].data == MetricEvent.model_validate_json(metric(3500, 0.5)).model_dump(exclude={"type"})
    assert job_row is not None and job_row.step == 3500 and job_row.tokens_seen == 35000


def test_a_diverged_loss_is_stored_as_null_and_the_poll_goes_on(database_url: str, tmp_path: Path) -> None:
    # JSON has no NaN: a Postgres json column refuses it, so one such line used to fail every poll.
    job = new_job()
    events = tmp_path / "events-1.jsonl"
    events.write_text(
        metric(1, 2.0).replace('"loss": 2.0', '"loss": NaN') + "\n" + metric(2, 1.0).replace("1.0", "Infinity") + "\n"
    )
    ingestor = EventIngestor(events_path=events, log_path=None, job_id=job.id)
    with Session(get_engine()) as session:
        assert ingestor.poll(session) == 2
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id).order_by(col(JobMetric.step))).all()
        assert [(r.step, r.loss) for r in rows] == [(1, None), (2, None)]
        data = session.exec(select(JobEvent.data).where(JobEvent.job_id == job.id)).all()
        assert [d["loss"] for d in data] == [None, None]


def test_a_ranks_warning_becomes_the_jobs_warning_event(database_url: str, tmp_path: Path) -> None:
    job = new_job()
    events = tmp_path / "events-1.jsonl"
    events.write_text(json.dumps({"type": "warning", "message": "the fused loss is off under ZeRO-3"}) + "\n")
    ingestor = EventIngestor(events_path=events, log_path=None, job_id=job.id)
    with Session(get_engine()) as session:
        assert ingestor.poll(session) == 1
        stream = session.exec(select(JobEvent).where(JobEvent.job_id == job.id)).all()
    assert [(e.type, e.data) for e in stream] == [("warning", {"message": "the fused loss is off under ZeRO-3"})]


# A DPO step as rank 0 reports it: TRL's measures, "/" spelt "_".
DPO_MEASURES = {
    "rewards_chosen": 0.5,
    "rewards_rejected": -0.25,
    "rewards_accuracies": 0.75,
    "rewards_margins": 0.75,
    "logps_chosen": -12.5,
    "logps_rejected": -20.0,
    "logits_chosen": 0.125,
    "logits_rejected": -0.125,
    "eval_rewards_accuracies": 0.875,
}


def dpo_metric(step: int, **measures: float) -> str:
    return json.dumps({**json.loads(metric(step, 0.6, step)), **DPO_MEASURES, **measures})


def phase(done: int, total: int, *, cached: bool = False) -> str:
    return json.dumps(
        {
            "type": "phase",
            "name": "reference_logps",
            "done": done,
            "total": total,
            "cached": cached,
            "time": "2026-01-01T00:00:00+00:00",
        }
    )


def test_a_dpo_jobs_phase_and_measures_become_rows(database_url: str, tmp_path: Path) -> None:
    """The reference pass's progress is a phase event per report and the job's phase (the
    latest); a step's DPO measures are its job_metrics row's columns and its event's data."""
    job = new_job()
    events = tmp_path / "events-1.jsonl"
    events.write_text(phase(0, 400) + "\n" + phase(120, 400) + "\n")
    ingestor = EventIngestor(events_path=events, log_path=None, job_id=job.id)
    with Session(get_engine()) as session:
        assert ingestor.poll(session) == 2
        stored = session.get(Job, job.id, populate_existing=True)
        assert stored is not None and stored.phase is not None
        assert (stored.phase["done"], stored.phase["total"], stored.phase["cached"]) == (120, 400, False)
        with events.open("a") as f:
            f.write(phase(400, 400) + "\n" + dpo_metric(1) + "\n")
        assert ingestor.poll(session) == 2
        row = session.exec(select(JobMetric).where(JobMetric.job_id == job.id)).one()
        stream = session.exec(select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id))).all()
        stored = session.get(Job, job.id, populate_existing=True)
    assert {name: getattr(row, name) for name in DPO_MEASURES} == DPO_MEASURES
    assert row.loss == 0.6
    assert [(e.type, e.data.get("done")) for e in stream] == [
        ("phase", 0),
        ("phase", 120),
        ("phase", 400),
        ("metric", None),
    ]
    assert stream[0].data == {
        "name": "reference_logps",
        "done": 0,
        "total": 400,
        "cached": False,
        "time": "2026-01-01T00:00:00+00:00",
    }
    assert {name: stream[-1].data[name] for name in DPO_MEASURES} == DPO_MEASURES  # the stream carries them as ingested
    assert stored is not None and stored.phase is not None and stored.phase["done"] == 400
    assert stored.latest_metrics is not None and stored.latest_metrics["rewards_accuracies"] == 0.75
