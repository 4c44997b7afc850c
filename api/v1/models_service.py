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

from pathlib import Path

from sqlmodel import Session, col, select

from api.model_sources import ModelNotNamed, fine_tuned_model_name, model_source
from api.v1.fine_tuning_objects import ModelListPublic, ModelPublic
from api.v1.fine_tuning_service import unix_seconds
from shared.db.models import Checkpoint, CheckpointKind, Job
from shared.jobs.model_source import FINE_TUNED_PREFIX
from shared.jobs.status import JobStatus
from shared.settings import Settings

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


def fine_tuned_models(*, session: Session, owner: str) -> list[ModelPublic]:
    """The models ``owner``'s succeeded jobs made, newest first."""
    jobs = session.exec(
        select(Job)
        .where(Job.owner == owner, Job.status == JobStatus.succeeded)
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
