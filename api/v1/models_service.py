"""What ``/v1/models`` lists: the base models this deployment offers and the models the caller's
jobs fine-tuned. No HTTP in here.

The base models are ``TUNEQ_BASE_MODELS`` when set (and then the only ones a job may train), else
the model directories directly under ``TUNEQ_ALLOWED_ROOTS`` (a ``config.json`` and safetensors
weights: what ``model`` may name). A fine-tuned model is named by its job's ``fine_tuned_model``
once the job succeeded, and each of its checkpoints by its ``fine_tuned_model_checkpoint`` (retrieved,
not listed); either is downloaded (``GET /jobs/{id}/artifacts``), not served, and either may be a
later job's ``model`` (``shared.jobs.model_source``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlmodel import Session, col, select

from api.artifact_download import artifact_store
from api.model_sources import ModelNotNamed, fine_tuned_model_name, model_source
from api.v1.fine_tuning_objects import ModelListPublic, ModelPublic
from api.v1.fine_tuning_service import unix_seconds
from shared.artifacts.store import ArtifactStoreError, job_key
from shared.db.artifacts import forget_checkpoint
from shared.db.models import Checkpoint, CheckpointKind, Job
from shared.jobs.model_source import FINE_TUNED_PREFIX
from shared.jobs.status import JobStatus
from shared.settings import Settings

logger = logging.getLogger(__name__)

BASE_MODEL_OWNER = "system"


def _model_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _saved_at(model: str) -> int:
    """A local model's config.json time; 0 for a hub model (not known without the hub)."""
    config = Path(model) / "config.json"
    return int(config.stat().st_mtime) if model.startswith("/") and config.is_file() else 0


def base_models(*, settings: Settings) -> list[ModelPublic]:
    names = settings.base_model_list
    if not names:
        names = sorted(
            str(child)
            for root in settings.allowed_root_paths
            if root.is_dir()
            for child in root.iterdir()
            if child.is_dir() and _model_directory(child)
        )
    return [ModelPublic(id=name, created=_saved_at(name), owned_by=BASE_MODEL_OWNER) for name in names]


# What a fine-tuned model is made of: its job's exported model, or its adapter (LoRA).
EXPORTED_KINDS = (CheckpointKind.model, CheckpointKind.adapter)


def fine_tuned_models(*, session: Session, owner: str) -> list[ModelPublic]:
    """The models ``owner``'s succeeded jobs exported (and that were not deleted), newest first."""
    exported = select(Checkpoint.id).where(col(Checkpoint.job_id) == Job.id, col(Checkpoint.kind).in_(EXPORTED_KINDS))
    jobs = session.exec(
        select(Job)
        .where(Job.owner == owner, Job.status == JobStatus.succeeded, exported.exists())
        .order_by(col(Job.finished_at).desc(), col(Job.id).desc())
    ).all()
    return [
        ModelPublic(id=fine_tuned_model_name(job), created=unix_seconds(job.finished_at) or 0, owned_by=owner)
        for job in jobs
    ]


def list_models(*, session: Session, settings: Settings, owner: str) -> ModelListPublic:
    return ModelListPublic(data=base_models(settings=settings) + fine_tuned_models(session=session, owner=owner))


def checkpoint_model(*, session: Session, owner: str, model: str) -> ModelPublic | None:
    """A checkpoint's ``fine_tuned_model_checkpoint`` (``ft:…:ckpt-step-<n>``) as a model: one of
    ``owner``'s, whose job succeeded, which a job's ``model`` can name. None for any other name."""
    try:
        source = model_source(session=session, model=model, owner=owner)
    except ModelNotNamed:
        return None
    if source.kind != "deepspeed":
        return None
    saved = session.exec(
        select(Checkpoint.created_at).where(
            Checkpoint.job_id == source.job_id,
            Checkpoint.step == source.step,
            Checkpoint.kind == CheckpointKind.deepspeed,
        )
    ).one()
    return ModelPublic(id=model, created=unix_seconds(saved) or 0, owned_by=owner)


def get_model(*, session: Session, settings: Settings, owner: str, model: str) -> ModelPublic | None:
    """One of the models ``list_models`` lists for ``owner``, or one of ``owner``'s checkpoints by
    its ``fine_tuned_model_checkpoint`` name; None for any other."""
    if model.startswith(FINE_TUNED_PREFIX) and (
        checkpoint := checkpoint_model(session=session, owner=owner, model=model)
    ):
        return checkpoint
    listed = list_models(session=session, settings=settings, owner=owner).data
    return next((m for m in listed if m.id == model), None)


class ModelNotDeletable(Exception):
    """A model the caller may not delete: a base model (403), or none of theirs (404)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def delete_fine_tuned_model(*, session: Session, settings: Settings, owner: str, model: str) -> None:
    """Delete one of ``owner``'s fine-tuned models (its ``fine_tuned_model`` name): the exported
    model's (or adapter's) rows go, then its files from the store; it leaves ``list_models``,
    and a job can no longer name it. Its job, events and DeepSpeed checkpoints stay. Raises
    ModelNotDeletable."""
    if any(m.id == model for m in base_models(settings=settings)):
        raise ModelNotDeletable(f"{model!r} is a base model this deployment offers: it cannot be deleted", 403)
    listed = {m.id for m in fine_tuned_models(session=session, owner=owner)}
    if model not in listed:
        raise ModelNotDeletable(f"The model {model!r} does not exist or you do not have access to it", 404)
    job_id = model_source(session=session, model=model, owner=owner).job_id
    exported = session.exec(
        select(Checkpoint).where(Checkpoint.job_id == job_id, col(Checkpoint.kind).in_(EXPORTED_KINDS))
    ).all()
    files = [
        artifact
        for checkpoint in exported
        for artifact in forget_checkpoint(session, checkpoint=checkpoint, reason=f"model {model} deleted by {owner}")
    ]
    session.commit()  # the rows first: nothing names the files once they start to go
    keys = [job_key(job_id, artifact.path) for artifact in files]
    try:
        artifact_store(settings).delete(keys)
    except ArtifactStoreError:
        logger.exception("model %s deleted, but %d of its files are left in the store", model, len(keys))
