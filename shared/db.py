"""Database engine and sessions, for the API and the worker alike."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlmodel import Session, SQLModel, create_engine

from shared import models  # noqa: F401  (registers the tables on SQLModel.metadata)
from shared.settings import Settings, get_settings

logger = logging.getLogger(__name__)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # The API and the worker are separate processes writing one file: WAL lets readers go on
    # while the worker writes a metric batch, and busy_timeout makes writers wait, not fail.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().database_url)


def init_db(settings: Settings | None = None, engine: Engine | None = None, attempts: int = 5) -> None:
    """Create the directories and the tables that do not exist yet.

    An API and a worker started together may both find a table missing and both create it;
    the loser retries, and then finds it there.
    """
    settings = settings or get_settings()
    settings.ensure_dirs()
    for attempt in range(1, attempts + 1):
        try:
            SQLModel.metadata.create_all(engine or get_engine())
            return
        except (OperationalError, ProgrammingError, IntegrityError) as e:
            if attempt == attempts:
                raise
            logger.info("creating tables raced another process (%s); again", type(e).__name__)
            time.sleep(0.2 * attempt)


@contextmanager
def session_scope() -> Iterator[Session]:
    with Session(get_engine(), expire_on_commit=False) as session:
        yield session
