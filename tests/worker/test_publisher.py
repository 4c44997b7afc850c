"""The worker's publisher: a checkpoint counts once every file is in the store, never before."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from sqlmodel import Session, col, select

from shared.artifacts.store import ArtifactStore, StoredFile
from shared.db.engine import get_engine
from shared.db.models import Artifact, Checkpoint, EventType, Job, JobEvent
from shared.jobs.events import CheckpointEvent
from shared.jobs.run_layout import CheckpointManifest, RunLayout
from worker import publisher as publisher_module
from worker.publisher import ArtifactPublisher


class FlakyStore(ArtifactStore):
    """A local store whose uploads fail after the first ``works`` of them (a store going away)."""

    def __init__(self, root: Path, *, works: int) -> None:
        super().__init__(str(root))
        self.works = works

    def put_file(self, source: Path, key: str) -> StoredFile:
        if self.works <= 0:
            raise ConnectionError("connection refused")
        self.works -= 1
        return super().put_file(source, key)


def saved(layout: RunLayout, step: int) -> CheckpointEvent:
    """What the ranks leave for the worker after saving a checkpoint at ``step``."""
    directory = layout.checkpoints_dir / layout.checkpoint_tag(step)
    (directory / "global_step").mkdir(parents=True)
    (directory / "global_step" / "optim_states.pt").write_bytes(b"o" * step)
    (directory / "model_states.pt").write_bytes(b"m" * step)
    manifest = CheckpointManifest.describe(
        directory, step=step, tag=directory.name, kind="deepspeed", world_size=1, created_at="t"
    )
    manifest.write(directory)
    return CheckpointEvent(
        step=step, kind="deepspeed", uri=str(directory), bytes=manifest.bytes, time="2026-12-06T00:00:00+00:00"
    )


def new_job(session: Session) -> Job:
    job = Job(model="a/b", dataset="/d", deepspeed_config={}, num_gpus=1, training={})
    session.add(job)
    session.commit()
    return job


def test_checkpoints_are_committed_with_their_files_and_retention_deletes_the_old(
    database_url: str, tmp_path: Path
) -> None:
    store = ArtifactStore(str(tmp_path / "store"))  # remote-like: not where the ranks write
    with Session(get_engine(), expire_on_commit=False) as session:
        job = new_job(session)
    layout = RunLayout(tmp_path / "worker" / str(job.id))
    publisher = ArtifactPublisher(job_id=job.id, layout=layout, store=store, deadline_seconds=5, keep_checkpoints=1)
    for step in (10, 20):
        publisher.submit(saved(layout, step))
    layout.log.write_text("the training log\n")
    assert publisher.finish(log=layout.log) is None

    with Session(get_engine()) as session:
        checkpoints = session.exec(select(Checkpoint).where(Checkpoint.job_id == job.id)).all()
        files = session.exec(select(Artifact).where(Artifact.job_id == job.id).order_by(col(Artifact.path))).all()
        events = session.exec(select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id))).all()
    assert [(c.step, c.uri) for c in checkpoints] == [(20, store.uri_of(f"{job.id}/checkpoints/step-00000020"))]
    assert [f.path for f in files] == [
        "checkpoints/step-00000020/global_step/optim_states.pt",
        "checkpoints/step-00000020/model_states.pt",
        "checkpoints/step-00000020/tuneq-manifest.json",
        "train.log",
    ]
    for f in files:  # each row says what the store holds
        held = (tmp_path / "store" / str(job.id) / f.path).read_bytes()
        assert (len(held), hashlib.sha256(held).hexdigest()) == (f.size, f.sha256)
    assert not (tmp_path / "store" / str(job.id) / "checkpoints" / "step-00000010" / "model_states.pt").exists()
    assert [(e.type, e.data.get("step")) for e in events] == [
        (EventType.checkpoint, 10),
        (EventType.checkpoint, 20),
        (EventType.artifact, 10),  # deleted: keep_checkpoints is 1
    ]
    assert events[2].data["state"] == "deleted"
    # The ranks may save the next one; the worker's disk keeps the newest only.
    assert layout.published_marker("step-00000020").exists()
    assert sorted(p.name for p in layout.checkpoints_dir.glob("step-*")) == ["step-00000020"]


@pytest.mark.parametrize("store_is_the_run_directory", [False, True], ids=["remote-store", "local-store"])
def test_after_a_full_disk_only_copies_the_store_holds_elsewhere_are_dropped(
    database_url: str, tmp_path: Path, store_is_the_run_directory: bool
) -> None:
    with Session(get_engine(), expire_on_commit=False) as session:
        job = new_job(session)
    runs = tmp_path / "runs"
    layout = RunLayout(runs / str(job.id))
    store = ArtifactStore(str(runs if store_is_the_run_directory else tmp_path / "store"))
    publisher = ArtifactPublisher(job_id=job.id, layout=layout, store=store, deadline_seconds=5, keep_checkpoints=None)
    publisher.submit(saved(layout, 10))
    assert publisher.finish(log=None) is None
    unpublished = saved(layout, 20)  # complete on disk, never published: the store lacks it
    if store_is_the_run_directory:
        assert publisher.drop_local_copies() == []  # the files are the store's own
        assert sorted(layout.local_checkpoints()) == [10, 20]
    else:
        assert publisher.drop_local_copies() == [10]
        assert sorted(layout.local_checkpoints()) == [20] and Path(unpublished.uri).is_dir()
        assert (tmp_path / "store" / str(job.id) / "checkpoints" / "step-00000010" / "model_states.pt").exists()


def test_a_checkpoint_whose_upload_never_finished_is_never_listed(database_url: str, tmp_path: Path) -> None:
    store = FlakyStore(tmp_path / "store", works=1)  # the store goes away after the first file
    with Session(get_engine(), expire_on_commit=False) as session:
        job = new_job(session)
    layout = RunLayout(tmp_path / "worker" / str(job.id))
    publisher = ArtifactPublisher(job_id=job.id, layout=layout, store=store, deadline_seconds=1.5, keep_checkpoints=3)
    publisher.submit(saved(layout, 10))
    problem = publisher.finish(log=None)

    assert problem is not None and "connection refused" in problem and publisher.gave_up
    with Session(get_engine()) as session:
        assert session.exec(select(Checkpoint).where(Checkpoint.job_id == job.id)).all() == []
        assert session.exec(select(Artifact).where(Artifact.job_id == job.id)).all() == []
        events = session.exec(select(JobEvent).where(JobEvent.job_id == job.id)).all()
    assert [e.data["state"] for e in events] == ["retrying"]
    assert not layout.published_marker("step-00000010").exists()  # the ranks would still wait
    assert (layout.checkpoints_dir / "step-00000010" / "model_states.pt").exists()  # kept for a retry


def test_a_checkpoint_that_cannot_be_published_for_another_reason_ends_the_attempt(
    database_url: str, tmp_path: Path
) -> None:
    """The ranks would wait for it forever: the publisher stops, as tuneq's own failure."""
    with Session(get_engine(), expire_on_commit=False) as session:
        job = new_job(session)
    layout = RunLayout(tmp_path / "worker" / str(job.id))
    publisher = ArtifactPublisher(
        job_id=job.id,
        layout=layout,
        store=ArtifactStore(str(tmp_path / "store")),
        deadline_seconds=5,
        keep_checkpoints=3,
    )
    event = saved(layout, 10)
    (layout.checkpoints_dir / "step-00000010" / CheckpointManifest.FILENAME).unlink()  # gone under it
    publisher.submit(event)
    assert publisher.finish(log=None) is not None
    assert publisher.gave_up and publisher.internal and "has no manifest" in (publisher.problem or "")


class SlowStore(ArtifactStore):
    """A local store whose every upload takes a while (a large final model on a slow link)."""

    def put_file(self, source: Path, key: str) -> StoredFile:
        time.sleep(0.2)
        return super().put_file(source, key)


def test_finish_lets_the_worker_keep_its_lease_while_the_last_uploads_run(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher_module, "FINISH_POLL_SECONDS", 0.05)
    with Session(get_engine(), expire_on_commit=False) as session:
        job = new_job(session)
    layout = RunLayout(tmp_path / "worker" / str(job.id))
    store = SlowStore(str(tmp_path / "store"))
    publisher = ArtifactPublisher(job_id=job.id, layout=layout, store=store, deadline_seconds=5, keep_checkpoints=None)
    publisher.submit(saved(layout, 10))  # three files: about 0.6 s of uploads
    renewals: list[float] = []
    assert publisher.finish(log=None, while_waiting=lambda: renewals.append(time.monotonic())) is None
    assert len(renewals) >= 5  # renewed all along, not once before or after
    with Session(get_engine()) as session:
        assert [c.step for c in session.exec(select(Checkpoint).where(Checkpoint.job_id == job.id))] == [10]
