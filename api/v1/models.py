"""OpenAI's models at ``/v1/models``: thin routes over ``api.v1.models_service``.

What the SDK's ``client.models`` calls: ``list``, ``retrieve`` and ``delete`` (a fine-tuned
model). A model id may hold slashes (a hub id, a local directory), so ``retrieve`` and ``delete``
take the rest of the path.
"""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import OwnerDep
from api.deps import ReadSessionDep, SessionDep, SettingsDep
from api.v1 import models_service
from api.v1.errors import PREFIX, OpenAIHTTPException, error
from api.v1.fine_tuning_objects import ModelDeletedPublic, ModelListPublic, ModelPublic

router = APIRouter(
    prefix=f"{PREFIX}/models",
    tags=["models (OpenAI-compatible)"],
    responses={"4XX": error("In OpenAI's envelope: 401 no key or a bad one, 404 no such model")},
)


@router.get("", response_model=ModelListPublic)
def list_models(session: ReadSessionDep, settings: SettingsDep, owner: OwnerDep) -> ModelListPublic:
    """The base models this deployment offers, then the caller's fine-tuned models, newest first."""
    return models_service.list_models(session=session, settings=settings, owner=owner)


@router.get("/{model:path}", response_model=ModelPublic, responses={404: error("No such model (or another owner's)")})
def retrieve_model(model: str, session: ReadSessionDep, settings: SettingsDep, owner: OwnerDep) -> ModelPublic:
    found = models_service.get_model(session=session, settings=settings, owner=owner, model=model)
    if found is None:
        raise OpenAIHTTPException(
            404, f"The model {model!r} does not exist or you do not have access to it", param="model"
        )
    return found


@router.delete(
    "/{model:path}",
    response_model=ModelDeletedPublic,
    responses={403: error("A base model"), 404: error("No such fine-tuned model (or another owner's)")},
)
def delete_model(model: str, session: SessionDep, settings: SettingsDep, owner: OwnerDep) -> ModelDeletedPublic:
    """Delete one of the caller's fine-tuned models: its exported files go, and it leaves the list."""
    try:
        models_service.delete_fine_tuned_model(session=session, settings=settings, owner=owner, model=model)
    except models_service.ModelNotDeletable as e:
        raise OpenAIHTTPException(e.status_code, str(e), param="model") from None
    return ModelDeletedPublic(id=model, deleted=True)
