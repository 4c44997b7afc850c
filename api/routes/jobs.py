from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import StreamingResponse
from sqlmodel import Session
from sse_starlette.sse import EventSourceResponse

from api import jobs_service, plan_service
from api.artifact_download import FILE_RESPONSES, serve_artifact
from api.auth import Caller, CallerDep, OwnerDep
from api.deps import ReadSessionDep, SessionDep, SettingsDep
from api.download_links import create_link
from api.errors import BODY_ERRORS, NOT_FOUND, UNAUTHORIZED, error
from api.jobs_service import JobAnswer
from api.read_cache import ReadCache
from api.streams import HEARTBEAT_SECONDS, event_stream, follow_log
from api.strict_json import StrictJSONRoute
from shared.db.artifacts import get_artifact, list_artifacts
from shared.db.engine import get_read_engine
from shared.db.lifecycle import JobStateError
from shared.db.models import (
    ArtifactPublic,
    ArtifactsPublic,
    CheckpointPublic,
    CheckpointsPublic,
    DownloadLinkCreate,
    DownloadLinkPublic,
    EventPublic,
    EventsPublic,
    EventType,
    Job,
    JobPublic,
    JobsPublic,
    LogsPublic,
    MetricsPublic,
)
from shared.jobs.plan import JobPlan
from shared.jobs.spec import JobCreate
from shared.jobs.status import JobStatus
from shared.jobs.validation import JobValidationError
from shared.settings import get_settings

# Every route takes the caller (CallerDep: reads and changes, which an admin's key may make on
# every owner's jobs) or its owner (OwnerDep: submits), which is what asks for the key (or finds
# auth off), and scopes what it reads by it. Not also a router-wide dependency: FastAPI would solve it
# a second time on every request (its cache saves the call, not the solving), a tenth of a
# cached GET /jobs/{id}; tests/api/test_auth.py checks that every route asks for the key.
router = APIRouter(prefix="/jobs", tags=["jobs"], route_class=StrictJSONRoute, responses=UNAUTHORIZED)

RETRY_AFTER_SECONDS = jobs_service.ActiveJobLimitError.RETRY_AFTER_SECONDS  # after a 429 for too many active jobs
# Offsets and event cursors are bound as SQL INTEGERs, 32 bits on Postgres (event ids are an INTEGER
# primary key, so no cursor is larger): a larger value is a 422 naming the parameter, not a 500.
SQL_INT_MAX = 2**31 - 1
# GET /jobs's sort: one of jobs_service.JOB_SORT_COLUMNS, '-' first for descending.
JOB_SORT_PATTERN = "^-?(" + "|".join(jobs_service.JOB_SORT_COLUMNS) + ")$"


def _not_found(job_id: uuid.UUID) -> HTTPException:
    """The answer for a missing job, and for another owner's job alike."""
    return HTTPException(status_code=404, detail=f"job {job_id} not found")


def _job_or_404(session: Session, job_id: uuid.UUID, caller: Caller) -> Job:
    job = jobs_service.get_job(session=session, job_id=job_id, caller=caller)
    if job is None:
        raise _not_found(job_id)
    return job


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    responses={
        200: {"model": JobPublic, "description": "The job an earlier request with this Idempotency-Key made"},
        409: error("The Idempotency-Key was used with a different body"),
        429: error("The owner has TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER active jobs; see Retry-After"),
        **BODY_ERRORS,
    },
)
def create_job(
    job_in: JobCreate,
    session: SessionDep,
    settings: SettingsDep,
    owner: OwnerDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobPublic:
    try:
        job, created = jobs_service.create_job(
            session=session, job_in=job_in, settings=settings, owner=owner, idempotency_key=idempotency_key
        )
    except JobValidationError as e:
        detail = [{"type": "value_error", "loc": list(p.loc), "msg": p.message} for p in e.problems]
        raise HTTPException(status_code=422, detail=detail) from None
    except jobs_service.IdempotencyConflictError as e:
        raise HTTPException(status_code=409, detail=str(e)) from None
    except jobs_service.ActiveJobLimitError as e:
        raise HTTPException(status_code=429, detail=str(e), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    if not created:
        response.status_code = status.HTTP_200_OK
    return jobs_service.job_public(session=session, job=job)


@router.post("/plan", response_model=JobPlan, responses=BODY_ERRORS)
def plan_job(job_in: JobCreate, session: SessionDep, settings: SettingsDep, owner: OwnerDep) -> JobPlan:
    """Validate a job and work out what it would do (dataset statistics, steps, memory per
    device) without running it. Same body and same 422 answers as ``POST /jobs``."""
    try:
        return plan_service.plan_job(session=session, job_in=job_in, settings=settings, owner=owner)
    except JobValidationError as e:
        detail = [{"type": "value_error", "loc": list(p.loc), "msg": p.message} for p in e.problems]
        raise HTTPException(status_code=422, detail=detail) from None


def _listed_owner(caller: Caller, owner: str | None) -> str | None:
    """Whose jobs GET /jobs lists: ``owner``'s or every owner's (None) for an admin's key, the
    caller's own otherwise; another owner's is a 403 that says which key may."""
    if caller.admin:
        return owner
    if owner is not None and owner != caller.owner:
        raise HTTPException(
            status_code=403,
            detail=f"owner: this key lists its own jobs ({caller.owner}'s); another owner's need an admin's key "
            "(`tuneq keys create --owner NAME --admin`)",
        )
    return caller.owner


@router.get("", response_model=JobsPublic, responses={403: error("owner is another's; the key is not an admin's")})
def list_jobs(
    session: ReadSessionDep,
    caller: CallerDep,
    owner: str | None = Query(
        default=None,
        max_length=200,
        description="An admin's key: this owner's jobs (every owner's when left out); any other key: its own",
    ),
    status: JobStatus | None = None,
    model: str | None = Query(default=None, max_length=1000, description="Jobs whose model contains this (any case)"),
    name: str | None = Query(default=None, max_length=200, description="Jobs whose name contains this (any case)"),
    created_after: Annotated[
        datetime | None, Query(description="Jobs created after this time (ISO 8601; UTC unless it says)")
    ] = None,
    sort: str = Query(
        default="-created_at",
        pattern=JOB_SORT_PATTERN,
        description="created_at, name, status, model or step; a leading '-' sorts newest or largest first",
    ),
    skip: int = Query(default=0, ge=0, le=SQL_INT_MAX),
    limit: int = Query(default=50, ge=1, le=500),
) -> JobsPublic:
    """The caller's jobs (an admin's key: every owner's, or ``owner``'s), a page at a time
    (``skip``, ``limit``), newest first unless ``sort`` says otherwise; ``count`` is how many
    match the filters in all, up to 1,000 with a ``model`` or ``name`` filter (``count_capped``:
    more match)."""
    query = jobs_service.JobListQuery(
        status=status,
        model=model,
        name=name,
        created_after=created_after.replace(tzinfo=UTC)
        if created_after and not created_after.tzinfo
        else created_after,
        sort=sort.removeprefix("-"),
        descending=sort.startswith("-"),
        skip=skip,
        limit=limit,
    )
    jobs, count, capped = jobs_service.list_jobs(session=session, owner=_listed_owner(caller, owner), query=query)
    data = [jobs_service.job_public(session=session, job=j) for j in jobs]
    return JobsPublic(data=data, count=count, count_capped=capped)


# How many jobs GET /jobs/lookup answers: enough to tell the caller which ids an ambiguous
# short id starts (its count says how many there are in all).
ID_PREFIX_MATCHES = 10


# Before GET /jobs/{job_id}, which would take "lookup" for a job id (and refuse it: not a UUID).
@router.get("/lookup", response_model=JobsPublic)
def lookup_jobs(
    session: ReadSessionDep,
    caller: CallerDep,
    id_prefix: str = Query(
        min_length=1,
        max_length=36,
        pattern="^-*(?:[0-9A-Fa-f]-*){1,32}$",  # 1 to 32 hex digits, with the dashes of an id or not
        description="The first characters of a job's id (a short id, as the dashboard and `tuneq jobs` show it)",
    ),
) -> JobsPublic:
    """The caller's jobs whose id starts with ``id_prefix`` (dashes ignored), newest first, at
    most 10; ``count`` is how many there are: one is the job a short id names."""
    prefix = id_prefix.replace("-", "").lower()
    jobs, count = jobs_service.jobs_with_id_prefix(
        session=session, owner=_listed_owner(caller, None), prefix=prefix, limit=ID_PREFIX_MATCHES
    )
    return JobsPublic(data=[jobs_service.job_public(session=session, job=j) for j in jobs], count=count)


def _read_job_answers(job_ids: list[uuid.UUID]) -> dict[uuid.UUID, JobAnswer]:
    # Runs in the thread pool, on the read-only (autocommit) engine like ReadSessionDep.
    with Session(get_read_engine(), expire_on_commit=False) as session:
        return jobs_service.job_answers(session=session, job_ids=job_ids)


@router.get("/{job_id}", response_model=JobPublic, responses=NOT_FOUND)
async def get_job(job_id: uuid.UUID, request: Request, caller: CallerDep) -> Response:
    # The route clients poll: answered from this process's recent read of the job when there is
    # one (api.read_cache, TUNEQ_JOB_CACHE_SECONDS), else read once for all the requests waiting,
    # together with the other jobs that missed meanwhile. The body is encoded once per read, so
    # the answer skips FastAPI's response validation.
    cache: ReadCache[uuid.UUID, JobAnswer] = request.app.state.job_cache
    answer = await cache.read_batched(job_id, ttl=get_settings().job_cache_seconds, load_many=_read_job_answers)
    if answer is None or not caller.sees(answer.owner):
        raise _not_found(job_id)
    return Response(answer.body, media_type="application/json")


def _change_job(
    request: Request, session: Session, job_id: uuid.UUID, caller: Caller, change: Callable[[], Job]
) -> JobPublic:
    """A request that changes the caller's job (cancel, pause, resume; an admin's key: any
    owner's): 404 for another owner's job, 409 for a job in a status it does not apply to, 429
    for a resume past the owner's active-job limit. This process's next GET of the job sees the change at once."""
    _job_or_404(session, job_id, caller)
    try:
        job = change()
    except JobStateError as e:
        raise HTTPException(status_code=409, detail=str(e)) from None
    except jobs_service.ActiveJobLimitError as e:
        raise HTTPException(status_code=429, detail=str(e), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    request.app.state.job_cache.forget(job_id)
    return jobs_service.job_public(session=session, job=job)


@router.post("/{job_id}/cancel", response_model=JobPublic, responses={**NOT_FOUND, 409: error("The job already ended")})
def cancel_job(job_id: uuid.UUID, request: Request, session: SessionDep, caller: CallerDep) -> JobPublic:
    """A queued or paused job is cancelled at once; a running one goes through `cancelling`."""
    change = partial(jobs_service.cancel_job, session=session, job_id=job_id)
    return _change_job(request, session, job_id, caller, change)


@router.post(
    "/{job_id}/pause",
    response_model=JobPublic,
    responses={**NOT_FOUND, 409: error("The job already ended, or is being cancelled")},
)
def pause_job(job_id: uuid.UUID, request: Request, session: SessionDep, caller: CallerDep) -> JobPublic:
    """A running job goes through `pausing` (its ranks save a checkpoint at their next step and
    exit, freeing the worker) to `paused`; a queued one is paused at once. Again: no change."""
    change = partial(jobs_service.pause_job, session=session, job_id=job_id)
    return _change_job(request, session, job_id, caller, change)


@router.post(
    "/{job_id}/resume",
    response_model=JobPublic,
    responses={
        **NOT_FOUND,
        409: error("The job is not paused"),
        429: error("The owner has TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER active jobs; see Retry-After"),
    },
)
def resume_job(
    job_id: uuid.UUID, request: Request, session: SessionDep, settings: SettingsDep, caller: CallerDep
) -> JobPublic:
    """A paused job is queued again; its next attempt continues from the pause's checkpoint."""
    return _change_job(
        request,
        session,
        job_id,
        caller,
        lambda: jobs_service.resume_job(session=session, job_id=job_id, settings=settings),
    )


@router.get("/{job_id}/metrics", response_model=MetricsPublic, responses=NOT_FOUND)
def get_metrics(
    job_id: uuid.UUID,
    session: ReadSessionDep,
    caller: CallerDep,
    after: int = Query(default=0, ge=0, le=SQL_INT_MAX, description="Steps after this one (a page's next_after)"),
    limit: int = Query(default=1000, ge=1, le=10_000),
    points: int | None = Query(
        default=None,
        ge=1,
        le=10_000,
        description="At most this many rows, spread evenly over the steps (the last of each stretch): a chart's series",
    ),
) -> MetricsPublic:
    """The job's per-step metrics in step order, a page at a time (``has_more``, ``next_after``)."""
    _job_or_404(session, job_id, caller)
    return jobs_service.list_metrics(session=session, job_id=job_id, after=after, limit=limit, points=points)


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic, responses=NOT_FOUND)
def get_checkpoints(job_id: uuid.UUID, session: ReadSessionDep, caller: CallerDep) -> CheckpointsPublic:
    _job_or_404(session, job_id, caller)
    rows = jobs_service.list_checkpoints(session=session, job_id=job_id)
    return CheckpointsPublic(data=[CheckpointPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/artifacts", response_model=ArtifactsPublic, responses=NOT_FOUND)
def get_artifacts(job_id: uuid.UUID, session: ReadSessionDep, caller: CallerDep) -> ArtifactsPublic:
    """Every file of the job in the artifact store: checkpoints, the model or adapter, the log."""
    _job_or_404(session, job_id, caller)
    rows = list_artifacts(session=session, job_id=job_id)
    return ArtifactsPublic(data=[ArtifactPublic.model_validate(r) for r in rows])


@router.get(
    "/{job_id}/artifacts/{path:path}",
    response_class=StreamingResponse,
    responses={**FILE_RESPONSES, **NOT_FOUND},
)
def download_artifact(
    job_id: uuid.UUID,
    path: str,
    session: ReadSessionDep,
    settings: SettingsDep,
    caller: CallerDep,
    range: Annotated[str | None, Header(max_length=200)] = None,
    if_range: Annotated[str | None, Header(max_length=200)] = None,
) -> Response:
    """One file, as ``path`` appears in the job's artifacts; ``Range: bytes=N-`` resumes."""
    _job_or_404(session, job_id, caller)
    artifact = get_artifact(session=session, job_id=job_id, path=path)
    if artifact is None:
        raise HTTPException(status_code=404, detail=f"job {job_id} has no artifact {path!r}")
    return serve_artifact(artifact, settings=settings, range_header=range, if_range=if_range)


@router.post(
    "/{job_id}/downloads", response_model=DownloadLinkPublic, status_code=201, responses={**NOT_FOUND, **BODY_ERRORS}
)
def create_download_link(
    job_id: uuid.UUID, link_in: DownloadLinkCreate, session: SessionDep, caller: CallerDep
) -> DownloadLinkPublic:
    """A link to one of the job's files that needs no key for 10 minutes (``GET`` it, Range
    included): what a browser or ``wget`` follows where it cannot send ``Authorization``."""
    _job_or_404(session, job_id, caller)
    if get_artifact(session=session, job_id=job_id, path=link_in.path) is None:
        raise HTTPException(status_code=404, detail=f"job {job_id} has no artifact {link_in.path!r}")
    token, expires_at = create_link(session=session, job_id=job_id, path=link_in.path, owner=caller.owner)
    return DownloadLinkPublic(url=f"/downloads/{token}", expires_at=expires_at)


def _sse(job_id: uuid.UUID, after: int) -> EventSourceResponse:
    return EventSourceResponse(event_stream(job_id, after), ping=HEARTBEAT_SECONDS)


@router.get(
    "/{job_id}/events",
    response_model=EventsPublic,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE with Accept: text/event-stream"},
        **NOT_FOUND,
    },
)
def get_events(
    job_id: uuid.UUID,
    request: Request,
    session: ReadSessionDep,
    caller: CallerDep,
    after: int = Query(
        default=0, ge=0, le=SQL_INT_MAX, description="Return events with an id greater than this cursor"
    ),
    limit: int = Query(default=100, ge=1, le=1000),
    type: Annotated[
        list[EventType] | None,
        Query(description="Only events of these types (repeat it: ?type=status&type=checkpoint); JSON answers only"),
    ] = None,
    last_event_id: Annotated[int | None, Header(ge=0, le=SQL_INT_MAX)] = None,
) -> EventsPublic | EventSourceResponse:
    _job_or_404(session, job_id, caller)
    cursor = last_event_id if last_event_id is not None else after
    if "text/event-stream" in request.headers.get("accept", ""):
        return _sse(job_id, cursor)
    rows = jobs_service.list_job_events(session=session, job_id=job_id, after=cursor, limit=limit, types=type)
    return EventsPublic(data=[EventPublic.model_validate(r) for r in rows], next_cursor=rows[-1].id if rows else None)


@router.get("/{job_id}/events/stream", responses={200: {"content": {"text/event-stream": {}}}, **NOT_FOUND})
def stream_events(
    job_id: uuid.UUID,
    session: ReadSessionDep,
    caller: CallerDep,
    after: int = Query(default=0, ge=0, le=SQL_INT_MAX),
    last_event_id: Annotated[int | None, Header(ge=0, le=SQL_INT_MAX)] = None,
) -> EventSourceResponse:
    """Server-Sent Events; ends after the job's terminal status. `Last-Event-ID` resumes."""
    _job_or_404(session, job_id, caller)
    return _sse(job_id, last_event_id if last_event_id is not None else after)


@router.get("/{job_id}/logs", response_model=LogsPublic, responses={200: {"content": {"text/plain": {}}}, **NOT_FOUND})
def get_logs(
    job_id: uuid.UUID,
    session: ReadSessionDep,
    settings: SettingsDep,
    caller: CallerDep,
    tail: int = Query(default=200, ge=1),
    follow: bool = Query(default=False, description="Stream new lines as text/plain until the job ends"),
) -> LogsPublic | StreamingResponse:
    """The job's last ``tail`` log lines, read from the ``log`` events the worker records; with
    ``follow``, those lines and then each new one as text/plain until the job has ended."""
    _job_or_404(session, job_id, caller)
    if follow:
        return StreamingResponse(
            follow_log(job_id, min(tail, settings.max_log_tail)), media_type="text/plain; charset=utf-8"
        )
    return LogsPublic(lines=jobs_service.read_log_tail(session=session, settings=settings, job_id=job_id, tail=tail))
