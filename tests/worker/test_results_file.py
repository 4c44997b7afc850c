"""A succeeded job's results file: its per-step metrics as CSV, kept as a file of its owner's."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from sqlmodel import Session, select

from shared.artifacts.store import ArtifactStore, file_key
from shared.db.engine import get_engine
from shared.db.models import File, Job, JobMetric, utcnow
from worker.results_file import COLUMNS, publish_results_file


def test_the_metrics_become_a_csv_file_of_the_owner_once(database_url: str, tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(owner="alice", model="m", dataset="d", deepspeed_config={}, num_gpus=1, training={})
        session.add(job)
        session.commit()
        for step in (2, 1):
            session.add(JobMetric(job_id=job.id, step=step, loss=3.0 - step, learning_rate=1e-5, time=utcnow()))
        session.commit()
    file_id = publish_results_file(job_id=job.id, store=store)
    assert file_id is not None and file_id.startswith("file-")
    assert publish_results_file(job_id=job.id, store=store) is None  # a redelivered outcome: still one
    with Session(get_engine()) as session:
        (row,) = session.exec(select(File).where(File.job_id == job.id)).all()
    assert (row.id, row.owner, row.purpose, row.filename, row.records) == (
        file_id,
        "alice",
        "fine-tune-results",
        "step_metrics.csv",
        2,
    )
    local = store.local_path(file_key(file_id))
    assert local is not None
    held = local.read_bytes()
    assert row.bytes == len(held)
    table = list(csv.DictReader(io.StringIO(held.decode(), newline="")))
    assert tuple(table[0]) == COLUMNS
    assert [(r["step"], r["train_loss"], r["valid_loss"]) for r in table] == [("1", "2.0", ""), ("2", "1.0", "")]


def test_a_dpo_jobs_file_adds_its_measures_under_trls_names(database_url: str, tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(owner="alice", model="m", dataset="d", deepspeed_config={}, num_gpus=1, training={})
        session.add(job)
        session.commit()
        session.add(
            JobMetric(job_id=job.id, step=1, loss=0.69, rewards_accuracies=0.0, rewards_margins=0.0, time=utcnow())
        )
        session.add(
            JobMetric(job_id=job.id, step=2, loss=0.5, rewards_accuracies=0.75, rewards_margins=0.4, time=utcnow())
        )
        session.commit()
    file_id = publish_results_file(job_id=job.id, store=store)
    assert file_id is not None
    local = store.local_path(file_key(file_id))
    assert local is not None
    table = list(csv.DictReader(io.StringIO(local.read_text(), newline="")))
    # Only the measures the job has: no empty columns of the ones it never reported.
    assert tuple(table[0]) == (*COLUMNS, "rewards/accuracies", "rewards/margins")
    assert [(r["train_loss"], r["rewards/accuracies"], r["rewards/margins"]) for r in table] == [
        ("0.69", "0.0", "0.0"),
        ("0.5", "0.75", "0.4"),
    ]
