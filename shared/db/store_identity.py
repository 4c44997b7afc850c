"""Which artifact store a deployment's processes share, so that one naming another is refused.

The API and every worker must name the same store (``TUNEQ_ARTIFACTS_URI``): a worker that
publishes a checkpoint where the next worker cannot read it loses the job on the first resume.
URIs cannot tell (the default, ``TUNEQ_HOME/runs``, is one path on every host yet a store per
host; one mounted directory may have a path per host), so the store is told by what it holds:
the first ``tuneq serve``, ``worker`` or ``dev`` to start on a database writes a marker object,
``.tuneq-store/<random id>``, into its store, then records the id in the database
(``artifact_store``, one row). Every later start reads the marker the database names from its own
store, and refuses to start without it (``claim_or_verify``); a resume whose checkpoint its store
lacks asks the same (``mismatch_now``), and fails at once rather than retry for a file that is
in another store.

Two first starts at once each write a marker of their own; the row's fixed key lets one insert
win, the other checks the winner's marker (in a shared store it is there) and removes its own.
The marker is written before the row, so a row always names a marker that was written: a store
unreachable at start refuses that start (as ``ArtifactStore.check`` does) and records nothing.
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session

from shared.artifacts.store import ArtifactStore, ArtifactStoreError
from shared.db.engine import session_scope
from shared.db.models import ArtifactStoreRecord, utcnow

logger = logging.getLogger(__name__)

MARKER_PREFIX = ".tuneq-store"
_ROW_ID = 1


class ArtifactStoreMismatch(ArtifactStoreError):
    """This process's store is not the one the database records; the message names both and
    ``TUNEQ_ARTIFACTS_URI``."""


def marker_key(store_id: str) -> str:
    return f"{MARKER_PREFIX}/{store_id}"


def recorded_store(session: Session) -> ArtifactStoreRecord | None:
    """The store the database records, or None before any process started on it."""
    return session.get(ArtifactStoreRecord, _ROW_ID)


def claim_or_verify(store: ArtifactStore) -> None:
    """At start: record ``store`` as the deployment's if none is yet, else check it is the one
    recorded. Raises ArtifactStoreMismatch when it is not, ArtifactStoreError when the store
    cannot be read or written now."""
    with session_scope() as session:
        recorded = recorded_store(session)
    if recorded is None:
        recorded = _claim(store)
    problem = mismatch(store, recorded)
    if problem is not None:
        raise ArtifactStoreMismatch(problem)


def _claim(store: ArtifactStore) -> ArtifactStoreRecord:
    """Write a marker into ``store``, then record it unless another process recorded its own
    first: the row that stands."""
    store_id = uuid.uuid4().hex
    key = marker_key(store_id)
    try:
        store.put_bytes(key, f"tuneq artifact store {store_id}\n".encode())
    except Exception as e:
        raise ArtifactStoreError(f"TUNEQ_ARTIFACTS_URI {store}: cannot write the marker {key} ({e})") from e
    with session_scope() as session:
        dialect = session.get_bind().dialect.name
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        row = {"id": _ROW_ID, "store_id": store_id, "uri": store.uri, "created_at": utcnow()}
        session.execute(insert(ArtifactStoreRecord).values(**row).on_conflict_do_nothing(index_elements=["id"]))
        session.commit()
        recorded = recorded_store(session)
    if recorded is None:  # nothing deletes the row
        raise RuntimeError("the artifact_store row vanished just after it was inserted")
    if recorded.store_id == store_id:
        logger.info("recorded the artifact store %s as this deployment's (marker %s)", store, key)
        return recorded
    # Another process started at the same moment and recorded its marker first: ours is litter.
    try:
        store.delete([key])
    except Exception as e:
        logger.warning("could not remove the unused marker %s from %s: %s", key, store, e)
    return recorded


def mismatch(store: ArtifactStore, recorded: ArtifactStoreRecord) -> str | None:
    """Why ``store`` is not the store ``recorded`` names (it lacks that marker), or None when it
    is. Raises ArtifactStoreError when the store cannot be read now."""
    key = marker_key(recorded.store_id)
    try:
        store.read_bytes(key)
    except FileNotFoundError:
        return _mismatch_message(store, recorded)
    except Exception as e:
        raise ArtifactStoreError(f"TUNEQ_ARTIFACTS_URI {store}: cannot read the marker {key} ({e})") from e
    return None


def _mismatch_message(store: ArtifactStore, recorded: ArtifactStoreRecord) -> str:
    key = marker_key(recorded.store_id)
    if store.uri == recorded.uri:  # the same name, yet not the store: emptied, or another host's directory
        which = (
            f"the database (TUNEQ_DATABASE_URL) recorded it with the marker {key}, which it now lacks: it was "
            "emptied or replaced, or it is a directory of the same path on another host"
        )
    else:
        which = (
            f"the database (TUNEQ_DATABASE_URL) records {recorded.uri}, where the first tuneq process to start on "
            f"it wrote the marker {key}, which {store.uri} lacks"
        )
    return (
        f"TUNEQ_ARTIFACTS_URI {store} is not this deployment's artifact store: {which}. The API and every worker "
        "must name one store: set TUNEQ_ARTIFACTS_URI to the same s3://bucket/prefix (or a directory every host "
        "mounts) for all of them; left unset, each process's store is its own TUNEQ_HOME/runs. A store moved on "
        f"purpose keeps its {MARKER_PREFIX}/ folder: copy it along (one emptied on purpose is recorded anew once "
        "the database's artifact_store row is deleted)"
    )


def mismatch_now(store: ArtifactStore) -> str | None:
    """``mismatch`` against the recorded store, for a resume whose checkpoint ``store`` lacks:
    None when it is the recorded store, when none is recorded yet (nothing to tell it by), or
    when the store cannot be read now (an outage, which the caller retries)."""
    with session_scope() as session:
        recorded = recorded_store(session)
    if recorded is None:
        return None
    try:
        return mismatch(store, recorded)
    except ArtifactStoreError:
        return None
