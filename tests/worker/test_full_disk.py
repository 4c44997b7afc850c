"""Ranks that run out of disk mid-save, on a real small disk (a tmpfs): the job goes back to the
queue under a name that says so, what the save left is removed, never a training error."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import Session, select

from shared.db.artifacts import newest_checkpoint
from shared.db.engine import get_engine
from shared.db.models import EventType, Job, JobEvent
from shared.jobs.hardware import Hardware
from shared.jobs.run_layout import RunLayout
from shared.jobs.status import JobStatus
from shared.settings import get_settings
from tests.conftest import clear_caches, require_service
from tests.worker.conftest import queued_training_job, run_as_a_pool_process
from worker.disk_space import disk_problem
from worker.launcher import Launcher

MB = 1024**2
DISK_MB = 16
# Room for the job's first checkpoint of the tiny model (about 2.3 MB with its optimizer's state),
# not for its second.
LEFT_FREE_MB = 4


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs with 4 MB left free, as a worker's disk that fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}M", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        require_service("a tmpfs mount (root)", mounted.stderr.strip())
    try:
        (mount / "ballast").write_bytes(b"\0" * ((DISK_MB - LEFT_FREE_MB) * MB))
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("empty_database_url", ["postgres"], indirect=True)
def test_a_save_that_fills_the_disk_requeues_the_job_naming_the_disk(
    database_url: str,
    tiny_model: Path,
    text_dataset: Path,
    small_disk: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TUNEQ_HOME", str(small_disk / "home"))
    monkeypatch.setenv("TUNEQ_MIN_FREE_DISK_MB", "1")
    clear_caches()
    job = queued_training_job(tiny_model, text_dataset, {"max_steps": 6, "checkpoint_every_steps": 1})
    launcher = Launcher(hardware=Hardware("cpu", 1), settings=get_settings())
    try:
        handed_back = run_as_a_pool_process(job, launcher)
    finally:
        launcher.close()
    assert not handed_back
    with Session(get_engine()) as session:
        seen = session.get(Job, job.id)
    assert seen is not None
    assert seen.status == JobStatus.queued, (seen.status, seen.error_code, seen.error_message)
    with Session(get_engine()) as session:
        committed = newest_checkpoint(session=session, job_id=job.id)
    assert committed is not None  # its first checkpoint fitted
    with Session(get_engine()) as session:
        warning = session.exec(
            select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.type == EventType.warning)
        ).first()
    assert warning is not None
    reason = str(warning.data["message"])
    assert "disk filled up" in reason and str(small_disk / "home") in reason, reason
    layout = RunLayout.for_job(get_settings(), job.id)
    assert not layout.incomplete_saves()  # the half-written save is gone: its space is free again
    assert list(layout.local_checkpoints()) == [committed.step]  # the committed one stays: it is the store
    # Its room was too little for a job, so this worker takes none until more is freed (the
    # next job would fill it the same way); then it does again.
    held = disk_problem(get_settings()) or ""
    assert f"filled up under job {job.id}" in held, held
    (small_disk / "ballast").unlink()
    assert disk_problem(get_settings()) is None
