"""The workers and the queues: what runs where, what waits and for how long, and who is asking
(``/me``). Thin routes over ``api.workers_service``; every owner sees the deployment's workers
and queues, and the ids of their own jobs only (an admin's key: every job's)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlmodel import SQLModel

from api import workers_service
from api.auth import CallerDep
from api.deps import ReadSessionDep, SettingsDep
from api.errors import UNAUTHORIZED
from api.workers_service import QueuesPublic, WorkersPublic

# Each route takes the caller (CallerDep) itself, as the job routes do (api.routes.jobs).
router = APIRouter(tags=["workers"], responses=UNAUTHORIZED)


@router.get("/workers", response_model=WorkersPublic)
def list_workers(session: ReadSessionDep, settings: SettingsDep, caller: CallerDep) -> WorkersPublic:
    """Every worker: its hardware, state (idle, busy, unavailable and why, stopped), last
    heartbeat, and the job it runs when that job is the caller's (an admin's key: any job)."""
    return workers_service.list_workers(session=session, settings=settings, caller=caller)


@router.get("/queues", response_model=QueuesPublic)
def list_queues(session: ReadSessionDep, settings: SettingsDep, caller: CallerDep) -> QueuesPublic:
    """Each size queue's queued one-node jobs (every owner's) and its oldest one's wait, its live
    workers, and the multi-node jobs waiting for enough idle workers."""
    return workers_service.list_queues(session=session, settings=settings, caller=caller)


class CallerPublic(SQLModel):
    owner: str
    admin: bool


@router.get("/me", response_model=CallerPublic)
def who_am_i(caller: CallerDep) -> CallerPublic:
    """The caller: its owner, and whether its key is an admin's (which sees every owner's jobs);
    the dashboard shows an owner filter to admins."""
    return CallerPublic(owner=caller.owner, admin=caller.admin)
