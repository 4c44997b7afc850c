"""What SQL says is in the artifact store: a job's published files and its committed checkpoints.

A checkpoint (a DeepSpeed checkpoint, an exported model or adapter) is committed in one
transaction, once every one of its files is in the store: its ``artifacts`` rows (each file's
size and SHA-256), its ``checkpoints`` row and its ``checkpoint`` event. Until then nothing
lists it, resumes from it or names it in ``resume_from``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from sqlmodel import Session, col, delete, select

from shared.artifacts.store import StoredFile
from shared.db.lifecycle import record_event
from shared.db.models import Artifact, ArtifactKind, Checkpoint, CheckpointKind, EventType


def publish_files(
    session: Session,
    *,
    job_id: uuid.UUID,
    files: Sequence[tuple[str, StoredFile]],
    kind: ArtifactKind,
    step: int | None,
) -> None:
    """List published files (``(path in the job, stored file)``); a path published again (a
    retried attempt exporting anew) replaces its row."""
    paths = [path for path, _ in files]
    if paths:
        session.exec(delete(Artifact).where(col(Artifact.job_id) == job_id, col(Artifact.path).in_(paths)))
    for path, stored in files:
        session.add(Artifact(job_id=job_id, path=path, kind=kind, step=step, size=stored.size, sha256=stored.sha256))


def commit_checkpoint(
    session: Session,
    *,
    job_id: uuid.UUID,
    kind: CheckpointKind,
    step: int,
    uri: str,
    files: Sequence[tuple[str, StoredFile]],
    created_at: datetime,
) -> bool:
    """Record a checkpoint whose files are all in the store; False if it already was."""
    known = select(Checkpoint.id).where(Checkpoint.job_id == job_id, Checkpoint.step == step, Checkpoint.kind == kind)
    if session.exec(known).first() is not None:
        return False
    publish_files(session, job_id=job_id, files=files, kind=ArtifactKind(kind.value), step=step)
    size = sum(stored.size for _, stored in files)
    session.add(Checkpoint(job_id=job_id, step=step, kind=kind, uri=uri, bytes=size, created_at=created_at))
    record_event(
        session,
        job_id=job_id,
        type=EventType.checkpoint,
        data={"step": step, "kind": kind.value, "uri": uri, "bytes": size, "time": created_at.isoformat()},
    )
    return True


def list_artifacts(*, session: Session, job_id: uuid.UUID) -> list[Artifact]:
    query = select(Artifact).where(Artifact.job_id == job_id).order_by(col(Artifact.path))
    return list(session.exec(query).all())


def get_artifact(*, session: Session, job_id: uuid.UUID, path: str) -> Artifact | None:
    return session.exec(select(Artifact).where(Artifact.job_id == job_id, Artifact.path == path)).first()


def checkpoint_files(*, session: Session, job_id: uuid.UUID, kind: ArtifactKind, step: int) -> list[Artifact]:
    """The published files of one checkpoint, in path order."""
    query = (
        select(Artifact)
        .where(Artifact.job_id == job_id, Artifact.kind == kind, Artifact.step == step)
        .order_by(col(Artifact.path))
    )
    return list(session.exec(query).all())


def newest_checkpoint(*, session: Session, job_id: uuid.UUID) -> Checkpoint | None:
    """The newest committed DeepSpeed checkpoint of a job: what a resume starts from."""
    query = (
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.kind == CheckpointKind.deepspeed)
        .order_by(col(Checkpoint.step).desc())
    )
    return session.exec(query).first()
