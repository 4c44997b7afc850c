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
from shared.db.models import (
    Artifact,
    ArtifactKind,
    Checkpoint,
    CheckpointKind,
    CheckpointUpload,
    EventType,
    Job,
    JobMetric,
)
from shared.jobs.status import JobStatus


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


def commit_node_share(
    session: Session,
    *,
    job_id: uuid.UUID,
    attempt: int,
    node_rank: int,
    num_nodes: int,
    step: int,
    uri: str,
    files: Sequence[tuple[str, StoredFile]],
    created_at: datetime,
) -> bool:
    """Record one node's uploaded share of a multi-node job's DeepSpeed checkpoint; the node
    whose share completes the set commits the checkpoint with every node's files (node 0's
    time and URI), in the same transaction. True if this call committed it. The caller commits.

    The job's row is locked first, so two nodes finishing together see each other's share: one
    of them commits (on SQLite, the single writer does the same). A share of an attempt that
    is no longer the job's (released, requeued, placed again) is not recorded: a new attempt
    may be writing the same paths."""
    job = session.exec(select(Job).where(col(Job.id) == job_id).with_for_update()).one()
    if job.attempts != attempt or job.status == JobStatus.queued:
        return False
    share = [{"path": path, "key": f.key, "size": f.size, "sha256": f.sha256} for path, f in files]
    session.merge(
        CheckpointUpload(
            job_id=job_id, attempt=attempt, step=step, node_rank=node_rank, uri=uri, files=share, created_at=created_at
        )
    )
    session.flush()
    shares = session.exec(
        select(CheckpointUpload).where(
            col(CheckpointUpload.job_id) == job_id,
            col(CheckpointUpload.attempt) == attempt,
            col(CheckpointUpload.step) == step,
        )
    ).all()
    if len(shares) < num_nodes:
        return False
    first = min(shares, key=lambda s: s.node_rank)
    every_file = [
        (f["path"], StoredFile(key=f["key"], size=f["size"], sha256=f["sha256"])) for s in shares for f in s.files
    ]
    committed = commit_checkpoint(
        session,
        job_id=job_id,
        kind=CheckpointKind.deepspeed,
        step=step,
        uri=first.uri,
        files=every_file,
        created_at=first.created_at,
    )
    for done in shares:
        session.delete(done)
    return committed


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


def checkpoints_past_retention(*, session: Session, job_id: uuid.UUID, keep: int) -> list[Checkpoint]:
    """The committed DeepSpeed checkpoints that ``training.keep_checkpoints = keep`` lets go:
    all but the newest ``keep`` and the one with the best eval_loss measured at its step."""
    checkpoints = list(
        session.exec(
            select(Checkpoint)
            .where(Checkpoint.job_id == job_id, Checkpoint.kind == CheckpointKind.deepspeed)
            .order_by(col(Checkpoint.step).desc())
        ).all()
    )
    kept = {c.step for c in checkpoints[:keep]}
    evaluated = session.exec(
        select(JobMetric.step, JobMetric.eval_loss).where(
            col(JobMetric.job_id) == job_id,
            col(JobMetric.step).in_([c.step for c in checkpoints]),
            col(JobMetric.eval_loss).is_not(None),
        )
    ).all()
    if evaluated:
        kept.add(min(evaluated, key=lambda row: (row[1], -row[0]))[0])
    return [c for c in checkpoints if c.step not in kept]


def forget_checkpoint(session: Session, *, checkpoint: Checkpoint, reason: str) -> list[Artifact]:
    """Un-commit a checkpoint (its rows go, an ``artifact`` event says why); its files, to be
    deleted from the store next. Nothing lists or resumes from it once this commits."""
    files = checkpoint_files(
        session=session, job_id=checkpoint.job_id, kind=ArtifactKind(checkpoint.kind.value), step=checkpoint.step
    )
    for artifact in files:
        session.delete(artifact)
    session.delete(checkpoint)
    record_event(
        session,
        job_id=checkpoint.job_id,
        type=EventType.artifact,
        data={"state": "deleted", "step": checkpoint.step, "kind": checkpoint.kind.value, "message": reason},
    )
    return files
