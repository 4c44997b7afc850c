"""A resume's fetch of its checkpoint keeps the job's lease however long the store's backoff,
and gives up at once on a store that is not the deployment's (issue 41): there a retry never
finds the file, and the job was lost as `worker_lost` after three such attempts."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from sqlmodel import Session

from shared.artifacts.store import ArtifactStore, ArtifactStoreError, StoreOutage
from shared.db.engine import get_engine
from shared.db.models import Job
from shared.db.store_identity import ArtifactStoreMismatch, claim_or_verify
from shared.jobs.run_layout import RunLayout
from tests.conftest import FakeClock
from tests.worker.test_runner import UnreachableStore, committed_checkpoint
from worker.checkpoint_fetch import fetch_checkpoint


def job_with_checkpoint(store: ArtifactStore, tmp_path: Path) -> Job:
    """A job whose checkpoint at step 10 is committed to ``store``."""
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config={}, num_gpus=1, training={}, attempts=2)
        session.add(job)
        session.commit()
        committed_checkpoint(session, store, RunLayout(tmp_path / "old-host" / str(job.id)), job, 10)
        session.commit()
    return job


def test_the_lease_is_kept_every_second_through_a_long_outage(
    database_url: str, tmp_path: Path, store_clock: FakeClock
) -> None:
    """Seven failures: waits of 1, 2, 4, 8, 16, 30 and 30 s. A keep-alive per try left gaps of up
    to 30 s, past a 10 s lease; the lease must be renewed every second of them instead."""
    job = job_with_checkpoint(ArtifactStore(str(tmp_path / "store")), tmp_path)
    kept_alive: list[float] = []
    directory = fetch_checkpoint(
        store=UnreachableStore(tmp_path / "store", failures=7),
        job_id=job.id,
        layout=RunLayout(tmp_path / "new-host" / str(job.id)),
        step=10,
        keep_alive=lambda: kept_alive.append(store_clock.now),
        deadline_seconds=600,
    )
    assert (directory / "shard.pt").read_bytes() == bytes([10]) * 10
    assert store_clock.now == 1 + 2 + 4 + 8 + 16 + 30 + 30
    moments = [0.0, *kept_alive, store_clock.now]  # the first failure, each keep-alive, the try that worked
    assert max(later - earlier for earlier, later in itertools.pairwise(moments)) <= StoreOutage.KEEP_ALIVE_SECONDS


def test_a_resume_from_a_store_that_is_not_the_deployments_fails_at_once(
    database_url: str, tmp_path: Path, store_clock: FakeClock
) -> None:
    """A worker whose TUNEQ_ARTIFACTS_URI was left unset (its own TUNEQ_HOME/runs) while the
    checkpoint went to the deployment's store: no retry, the message says what to set."""
    shared = ArtifactStore(str(tmp_path / "api-host" / "runs"))
    claim_or_verify(shared)  # as the first `tuneq serve` did
    job = job_with_checkpoint(shared, tmp_path)
    own = ArtifactStore(str(tmp_path / "worker-host" / "runs"))
    kept_alive: list[float] = []
    with pytest.raises(ArtifactStoreMismatch) as refused:
        fetch_checkpoint(
            store=own,
            job_id=job.id,
            layout=RunLayout(tmp_path / "worker-host" / "runs" / str(job.id)),
            step=10,
            keep_alive=lambda: kept_alive.append(store_clock.now),
            deadline_seconds=600,
        )
    message = str(refused.value)
    assert message.startswith("the checkpoint is not in this worker's artifact store")
    assert f"TUNEQ_ARTIFACTS_URI {own.uri} is not this deployment's artifact store" in message
    assert f"records {shared.uri}" in message
    assert (store_clock.now, kept_alive) == (0.0, [])  # not a second of backoff

    # The deployment's own store, down a moment, is still waited for (not taken for another).
    back_soon = UnreachableStore(tmp_path / "api-host" / "runs", failures=2)
    layout = RunLayout(tmp_path / "third" / str(job.id))
    fetch_checkpoint(store=back_soon, job_id=job.id, layout=layout, step=10, deadline_seconds=600)
    assert store_clock.now == 1 + 2


def test_without_a_recorded_store_a_missing_checkpoint_is_retried_to_the_deadline(
    database_url: str, tmp_path: Path, store_clock: FakeClock
) -> None:
    """A database no tuneq process has started on (a worker of an older release, tests calling
    the worker directly) tells no store from another: the deadline decides, as before."""
    job = job_with_checkpoint(ArtifactStore(str(tmp_path / "store")), tmp_path)
    with pytest.raises(ArtifactStoreError, match="stayed unreachable for more than 60s") as gave_up:
        fetch_checkpoint(
            store=ArtifactStore(str(tmp_path / "elsewhere")),
            job_id=job.id,
            layout=RunLayout(tmp_path / "new-host" / str(job.id)),
            step=10,
            deadline_seconds=60,
        )
    assert not isinstance(gave_up.value, ArtifactStoreMismatch)
