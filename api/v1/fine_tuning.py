"""OpenAI's fine-tuning jobs at ``/v1/fine_tuning/jobs``: thin routes over
``api.v1.fine_tuning_service``.

What the SDK's ``client.fine_tuning.jobs`` calls: ``create``, ``list`` (``after``, ``limit``,
``metadata``), ``retrieve``, ``cancel``, ``pause``, ``resume``, ``list_events`` and ``checkpoints.list``, with OpenAI's
object shapes and error envelope. The jobs are the native ``/jobs`` ones: ``ftjob-<hex>`` here
is ``/jobs/<uuid>`` there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from sqlmodel import Session

from api import jobs_service
from api.auth import OwnerDep
from api.deps import ReadSessionDep, SessionDep, SettingsDep
from api.errors import Responses
from api.strict_json import StrictJSONRoute
from api.v1 import fine_tuning_service as service
from api.v1.errors import PREFIX, OpenAIHTTPException, error
from api.v1.fine_tuning_objects import (
    FineTuningJobCheckpointListPublic,
    FineTuningJobCreate,
    FineTuningJobEventListPublic,
    FineTuningJobListPublic,
    FineTuningJobPublic,
)
from api.v1.pages import After
from shared.db.lifecycle import JobStateError
from shared.db.models import Job

router = APIRouter(
    prefix=f"{PREFIX}/fine_tuning/jobs",
    tags=["fine-tuning (OpenAI-compatible)"],
    route_class=StrictJSONRoute,
    responses={"4XX": error("In OpenAI's envelope: 400 a bad parameter, 401 no key or a bad one, 404 no such job")},
)

NOT_FOUND: Responses = {404: error("No such job (or one of another owner)")}
Limit = Annotated[int, Query(ge=1, le=service.MAX_LIST_LIMIT, description="Items on one page")]
# The SDK waits this long before its retry of a 429, as a native client does.
_RETRY_AFTER = {"Retry-After": str(jobs_service.ActiveJobLimitError.RETRY_AFTER_SECONDS)}


def _job_or_404(session: Session, fine_tuning_job_id: str, owner: str) -> Job:
    job = service.get_fine_tuning_job(session=session, fine_tuning_job_id=fine_tuning_job_id, owner=owner)
    if job is None:
        raise OpenAIHTTPException(404, f"No fine-tuning job found with id {fine_tuning_job_id!r}", param="id")
    return job


def _metadata_filter(request: Request) -> dict[str, str] | None:
    """``metadata[key]=value`` pairs (OpenAI's deep-object form, as the SDK sends it)."""
    pairs = {
        name[len("metadata[") : -1]: value
        for name, value in request.query_params.multi_items()
        if name.startswith("metadata[") and name.endswith("]")
    }
    return pairs or None


@router.post(
    "",
    response_model=FineTuningJobPublic,
    responses={
        400: error("A bad parameter: a file that is not the caller's, a hyperparameter out of bounds, a bad model"),
        409: error("The Idempotency-Key was used with a different body"),
        429: error("The owner has TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER active jobs"),
    },
)
def create_fine_tuning_job(
    body: FineTuningJobCreate,
    session: SessionDep,
    settings: SettingsDep,
    owner: OwnerDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> FineTuningJobPublic:
    """Fine-tune ``model`` on an uploaded ``training_file``: tuneq resolves "auto"
    hyperparameters and chooses the DeepSpeed config; the job is queued at once."""
    try:
        job = service.create_fine_tuning_job(
            session=session, settings=settings, owner=owner, request=body, idempotency_key=idempotency_key
        )
    except jobs_service.IdempotencyConflictError as e:
        raise OpenAIHTTPException(409, str(e), param="Idempotency-Key", code="idempotency_key_reused") from None
    except jobs_service.ActiveJobLimitError as e:
        raise OpenAIHTTPException(429, str(e), code="rate_limit_exceeded", headers=_RETRY_AFTER) from None
    return service.fine_tuning_job_public(job, session=session)


@router.get(
    "",
    response_model=FineTuningJobListPublic,
    responses={400: error("`after` names no job of the caller's")},
)
def list_fine_tuning_jobs(
    request: Request,
    session: ReadSessionDep,
    owner: OwnerDep,
    after: After = None,
    limit: Limit = service.DEFAULT_JOBS_LIMIT,
) -> FineTuningJobListPublic:
    """The caller's jobs, newest first (native ones too). ``metadata[key]=value`` query
    parameters keep the jobs whose metadata holds every such pair."""
    return service.list_fine_tuning_jobs(
        session=session, owner=owner, after=after, limit=limit, metadata=_metadata_filter(request)
    )


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJobPublic, responses=NOT_FOUND)
def retrieve_fine_tuning_job(fine_tuning_job_id: str, session: ReadSessionDep, owner: OwnerDep) -> FineTuningJobPublic:
    return service.fine_tuning_job_public(_job_or_404(session, fine_tuning_job_id, owner), session=session)


# Which jobs each change applies to, in /v1's terms (the native API's messages name its routes).
_APPLIES_TO = {
    "cancel": "only a queued, running or paused job can be cancelled",
    "pause": "only a queued or running job can be paused",
    "resume": "only a paused job can be resumed (POST /v1/fine_tuning/jobs/{id}/pause pauses a queued or running one)",
}


def _change_job(
    request: Request, session: Session, fine_tuning_job_id: str, owner: str, action: str, change: Callable[[Job], Job]
) -> FineTuningJobPublic:
    """A request that changes the caller's job (cancel, pause, resume: ``action``), as the native
    routes do: 404 for another owner's job, 409 for a status it does not apply to, 429 for a
    resume past the owner's active-job limit; the native GET /jobs/{id} sees the change at once."""
    job = _job_or_404(session, fine_tuning_job_id, owner)
    try:
        job = change(job)
    except JobStateError:
        session.refresh(job)
        status = service.fine_tuning_status(job)
        applies_to = _APPLIES_TO[action].replace("{id}", fine_tuning_job_id)
        raise OpenAIHTTPException(
            409, f"fine-tuning job {fine_tuning_job_id} is {status}; {applies_to}", param="id", code="invalid_state"
        ) from None
    except jobs_service.ActiveJobLimitError as e:
        raise OpenAIHTTPException(429, str(e), code="rate_limit_exceeded", headers=_RETRY_AFTER) from None
    request.app.state.job_cache.forget(job.id)
    return service.fine_tuning_job_public(job, session=session)


@router.post(
    "/{fine_tuning_job_id}/cancel",
    response_model=FineTuningJobPublic,
    responses={**NOT_FOUND, 409: error("The job already succeeded or failed")},
)
def cancel_fine_tuning_job(
    fine_tuning_job_id: str, request: Request, session: SessionDep, owner: OwnerDep
) -> FineTuningJobPublic:
    """A queued or paused job is cancelled at once; a running one stops within the grace period."""
    return _change_job(
        request,
        session,
        fine_tuning_job_id,
        owner,
        "cancel",
        lambda job: jobs_service.cancel_job(session=session, job_id=job.id),
    )


@router.post(
    "/{fine_tuning_job_id}/pause",
    response_model=FineTuningJobPublic,
    responses={**NOT_FOUND, 409: error("The job already ended, or is being cancelled")},
)
def pause_fine_tuning_job(
    fine_tuning_job_id: str, request: Request, session: SessionDep, owner: OwnerDep
) -> FineTuningJobPublic:
    """A running job saves a checkpoint at its next step and stops, freeing its worker; a queued
    one is paused at once."""
    return _change_job(
        request,
        session,
        fine_tuning_job_id,
        owner,
        "pause",
        lambda job: jobs_service.pause_job(session=session, job_id=job.id),
    )


@router.post(
    "/{fine_tuning_job_id}/resume",
    response_model=FineTuningJobPublic,
    responses={
        **NOT_FOUND,
        409: error("The job is not paused"),
        429: error("The owner has TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER active jobs"),
    },
)
def resume_fine_tuning_job(
    fine_tuning_job_id: str, request: Request, session: SessionDep, settings: SettingsDep, owner: OwnerDep
) -> FineTuningJobPublic:
    """A paused job is queued again and continues from the checkpoint its pause saved."""
    return _change_job(
        request,
        session,
        fine_tuning_job_id,
        owner,
        "resume",
        lambda job: jobs_service.resume_job(session=session, job_id=job.id, settings=settings),
    )


@router.get("/{fine_tuning_job_id}/events", response_model=FineTuningJobEventListPublic, responses=NOT_FOUND)
def list_fine_tuning_events(
    fine_tuning_job_id: str,
    session: ReadSessionDep,
    owner: OwnerDep,
    after: After = None,
    limit: Limit = service.DEFAULT_EVENTS_LIMIT,
) -> FineTuningJobEventListPublic:
    """The job's events, newest first: status changes, its plan, per-step metrics (``type``
    ``metrics``), checkpoints and warnings."""
    job = _job_or_404(session, fine_tuning_job_id, owner)
    return service.list_fine_tuning_events(session=session, job=job, after=after, limit=limit)


@router.get("/{fine_tuning_job_id}/checkpoints", response_model=FineTuningJobCheckpointListPublic, responses=NOT_FOUND)
def list_fine_tuning_checkpoints(
    fine_tuning_job_id: str,
    session: ReadSessionDep,
    owner: OwnerDep,
    after: After = None,
    limit: Limit = service.DEFAULT_CHECKPOINTS_LIMIT,
) -> FineTuningJobCheckpointListPublic:
    """The job's resumable checkpoints, newest first, with the metrics of their step."""
    job = _job_or_404(session, fine_tuning_job_id, owner)
    return service.list_fine_tuning_checkpoints(session=session, job=job, after=after, limit=limit)
