"""The deployment's artifact store is recorded by the first process to start, and a process
naming another store refuses to start, saying to set TUNEQ_ARTIFACTS_URI (issue 41: a worker on
its own TUNEQ_HOME/runs could not read the checkpoints the others published, and lost the job)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlmodel import Session, select

from shared.artifacts.store import ArtifactStore, ArtifactStoreError
from shared.db.engine import get_engine, migrate_database
from shared.db.models import ArtifactStoreRecord
from shared.db.store_identity import MARKER_PREFIX, ArtifactStoreMismatch, claim_or_verify, marker_key
from shared.ports import free_port
from tests.conftest import clear_caches
from tests.services import fresh_postgres_schema
from tests.together import run_together


def recorded(database_url: str) -> list[ArtifactStoreRecord]:
    with Session(get_engine()) as session:
        return list(session.exec(select(ArtifactStoreRecord)).all())


def markers(root: Path) -> list[str]:
    folder = root / MARKER_PREFIX
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_the_first_start_records_its_store_and_only_that_store_starts_after_it(
    database_url: str, tmp_path: Path
) -> None:
    shared = tmp_path / "shared-store"
    claim_or_verify(ArtifactStore(str(shared)))
    (row,) = recorded(database_url)
    assert row.uri == str(shared) and markers(shared) == [row.store_id]

    # The same store under another name (a mount seen through a symlink here, another path on
    # another host), or moved whole on purpose: the marker tells, not the URI.
    alias = tmp_path / "mounted-here"
    alias.symlink_to(shared)
    moved = tmp_path / "moved-store"
    shutil.copytree(shared, moved)
    for same in (str(shared), f"file://{alias}", str(moved)):
        claim_or_verify(ArtifactStore(same))
    assert [r.store_id for r in recorded(database_url)] == [row.store_id] and markers(shared) == [row.store_id]

    own = tmp_path / "worker-host" / "runs"  # TUNEQ_ARTIFACTS_URI unset on another host
    with pytest.raises(ArtifactStoreMismatch) as refused:
        claim_or_verify(ArtifactStore(str(own)))
    message = str(refused.value)
    assert message.startswith(f"TUNEQ_ARTIFACTS_URI {own} is not this deployment's artifact store")
    assert f"records {shared}" in message and marker_key(row.store_id) in message
    assert "set TUNEQ_ARTIFACTS_URI to the same" in message and "TUNEQ_HOME/runs" in message
    assert markers(own) == [] and len(recorded(database_url)) == 1  # the refused start left nothing

    # A store emptied since (or a directory of the same path on another host): the same URI, refused.
    (shared / marker_key(row.store_id)).unlink()
    with pytest.raises(ArtifactStoreMismatch, match="which it now lacks: it was emptied or replaced"):
        claim_or_verify(ArtifactStore(str(shared)))


class StoreDown(ArtifactStore):
    """A store that cannot be written, as S3 during an outage."""

    def put_bytes(self, key: str, data: bytes) -> None:
        raise ConnectionError("connection refused")


def test_a_store_down_at_the_first_start_records_nothing(database_url: str, tmp_path: Path) -> None:
    """That start is refused (as when the store cannot be written at all), and the next one,
    with the store back, records it: an outage never leaves a row naming a marker nobody wrote."""
    store = tmp_path / "store"
    with pytest.raises(ArtifactStoreError, match=r"cannot write the marker .*connection refused") as refused:
        claim_or_verify(StoreDown(str(store)))
    assert not isinstance(refused.value, ArtifactStoreMismatch)
    assert recorded(database_url) == []
    claim_or_verify(ArtifactStore(str(store)))
    assert [r.uri for r in recorded(database_url)] == [str(store)]


def test_first_starts_at_once_record_one_store(database_url: str, tmp_path: Path) -> None:
    """Four processes on an empty database and one store at the same moment: each writes a
    marker, one insert wins, all of them start, and the losers' markers are removed."""
    store = tmp_path / "store"
    env = {**os.environ, "TUNEQ_DATABASE_URL": database_url}
    setup = "from shared.artifacts.store import ArtifactStore; from shared.db.store_identity import claim_or_verify"
    run_together(setup, f"claim_or_verify(ArtifactStore({str(store)!r}))", env=env, n=4)
    (row,) = recorded(database_url)
    assert markers(store) == [row.store_id]


@pytest.fixture
def postgres_database(tuneq_home: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A migrated Postgres schema as TUNEQ_DATABASE_URL: the database processes on several homes
    share (an embedded one is a home's own)."""
    url = fresh_postgres_schema(postgres_url)
    migrate_database(url)
    monkeypatch.setenv("TUNEQ_DATABASE_URL", url)
    clear_caches()
    return url


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_a_process_naming_another_store_refuses_to_start(
    command: str, postgres_database: str, tmp_path: Path, tuneq_home: Path
) -> None:
    """Issue 41's deployment: the API and the first worker on their homes, sharing Postgres,
    TUNEQ_ARTIFACTS_URI unset. A second process on a home of its own names its own
    TUNEQ_HOME/runs: one line naming the setting and both stores, exit 1, nothing started."""
    first = tuneq_home / "runs"
    claim_or_verify(ArtifactStore(str(first)))  # as the first `tuneq serve` did
    other_home = tmp_path / "other-host"
    env = {
        **os.environ,
        "TUNEQ_HOME": str(other_home),
        "TUNEQ_DATABASE_URL": postgres_database,
        "TUNEQ_LOG_LEVEL": "WARNING",
    }
    env.pop("TUNEQ_ARTIFACTS_URI", None)
    args = ["--port", str(free_port())] if command == "serve" else []
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", command, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"tuneq: TUNEQ_ARTIFACTS_URI {other_home / 'runs'} is not this deployment's artifact store")
    assert f"records {first}" in line and "set TUNEQ_ARTIFACTS_URI to the same" in line
    assert "Traceback" not in result.stderr
    assert markers(other_home / "runs") == []
