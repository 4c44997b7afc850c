from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import anyio.to_thread
from anyio import CancelScope, CapacityLimiter
from fastapi import Depends
from sqlmodel import Session

from shared.db.engine import get_engine, get_read_engine
from shared.settings import Settings, get_settings


async def get_session() -> AsyncIterator[Session]:
    """A session for the request, made and (when it never connected) closed on the event loop.

    Async on purpose: a sync dependency costs two trips through the thread pool (enter, exit),
    which is a good part of a small read's time under load. Making a Session does no I/O (it
    connects on first use); closing one that holds a connection does (a ROLLBACK as the
    connection goes back to the pool), so that close runs in a thread, shielded from
    cancellation and without waiting for a thread-pool token, as FastAPI closes sync
    dependencies (a close waiting behind requests that wait for a connection would deadlock).
    """
    session = Session(get_engine(), expire_on_commit=False)
    try:
        yield session
    finally:
        if session.in_transaction():
            with CancelScope(shield=True):
                await anyio.to_thread.run_sync(session.close, limiter=CapacityLimiter(1))
        else:
            session.close()


async def get_read_session() -> AsyncIterator[Session]:
    """A session for a route that only reads, on the autocommit engine (``get_read_engine``):
    no BEGIN before its statements, no ROLLBACK after, so closing it does no I/O and it is
    made and closed on the event loop."""
    session = Session(get_read_engine(), expire_on_commit=False)
    try:
        yield session
    finally:
        session.close()


async def settings_dependency() -> Settings:
    # Async so that reading the (cached) settings does not take a trip through the thread pool.
    return get_settings()


# Closed when the route function returns, not when the response ends: an event stream or a
# followed log may stay open for hours, and must not hold a pooled connection all that time
# (it opens short sessions of its own). Routes return plain models, so nothing reads the
# session after the function.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(settings_dependency)]
