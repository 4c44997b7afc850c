"""What ``/v1/models`` lists: the base models this deployment offers and the models the caller's
jobs fine-tuned. No HTTP in here.

The base models are ``TUNEQ_BASE_MODELS`` when set (and then the only ones a job may train), else
the model directories directly under ``TUNEQ_ALLOWED_ROOTS`` (a ``config.json`` and safetensors
weights: what ``model`` may name). A fine-tuned model is named by its job's ``fine_tuned_model``
once the job succeeded; it is downloaded (``GET /jobs/{id}/artifacts``), not served.
"""

from __future__ import annotations

from pathlib import Path

from sqlmodel import Session, col, select

from api.v1.fine_tuning_objects import ModelListPublic, ModelPublic
from api.v1.fine_tuning_service import fine_tuned_model_name, unix_seconds
from shared.db.models import Job
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


def get_model(*, session: Session, settings: Settings, owner: str, model: str) -> ModelPublic | None:
    """One of the models ``list_models`` lists for ``owner``; None for any other."""
    listed = list_models(session=session, settings=settings, owner=owner).data
    return next((m for m in listed if m.id == model), None)
