from __future__ import annotations

import uuid

from fastapi import APIRouter, HTTPException, Query, status

from api import jobs_service
from api.deps import SessionDep, SettingsDep
from shared.models import (
    CheckpointPublic,
    CheckpointsPublic,
    Job,
    JobPublic,
    JobsPublic,
    JobStatus,
    LogsPublic,
    MetricPublic,
    MetricsPublic,
)
from shared.spec import JobCreate
from shared.validation import JobValidationError

router = APIRouter(prefix="/jobs", tags=["jobs"])


def _job_or_404(session: SessionDep, job_id: uuid.UUID) -> Job:
    job = jobs_service.get_job(session=session, job_id=job_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"job {job_id} not found")
    return job


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic)
def create_job(job_in: JobCreate, session: SessionDep, settings: SettingsDep) -> JobPublic:
    try:
        job = jobs_service.create_job(session=session, job_in=job_in, settings=settings)
    except JobValidationError as e:
        detail = [{"type": "value_error", "loc": list(p.loc), "msg": p.message} for p in e.problems]
        raise HTTPException(status_code=422, detail=detail) from None
    return JobPublic.from_job(job)


@router.get("", response_model=JobsPublic)
def list_jobs(
    session: SessionDep,
    status: JobStatus | None = None,
    skip: int = Query(default=0, ge=0),
    limit: int = Query(default=50, ge=1, le=500),
) -> JobsPublic:
    jobs, count = jobs_service.list_jobs(session=session, status=status, skip=skip, limit=limit)
    return JobsPublic(data=[JobPublic.from_job(j) for j in jobs], count=count)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: uuid.UUID, session: SessionDep) -> JobPublic:
    return JobPublic.from_job(_job_or_404(session, job_id))


@router.get("/{job_id}/metrics", response_model=MetricsPublic)
def get_metrics(job_id: uuid.UUID, session: SessionDep) -> MetricsPublic:
    _job_or_404(session, job_id)
    rows = jobs_service.list_metrics(session=session, job_id=job_id)
    return MetricsPublic(data=[MetricPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic)
def get_checkpoints(job_id: uuid.UUID, session: SessionDep) -> CheckpointsPublic:
    _job_or_404(session, job_id)
    rows = jobs_service.list_checkpoints(session=session, job_id=job_id)
    return CheckpointsPublic(data=[CheckpointPublic.model_validate(r) for r in rows])


@router.get("/{job_id}/logs", response_model=LogsPublic)
def get_logs(
    job_id: uuid.UUID, session: SessionDep, settings: SettingsDep, tail: int = Query(default=200, ge=1)
) -> LogsPublic:
    _job_or_404(session, job_id)
    return LogsPublic(lines=jobs_service.read_log_tail(settings=settings, job_id=job_id, tail=tail))
