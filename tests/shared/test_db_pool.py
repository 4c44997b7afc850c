"""The Postgres pool: every connection kept (no overflow churn), a dead one replaced."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text

from shared import db


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(postgres_url: str, pid: int) -> None:
    import sqlalchemy

    admin = sqlalchemy.create_engine(postgres_url)
    with admin.begin() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    admin.dispose()


def test_connections_are_all_kept_up_to_the_pool_size(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # No overflow: a connection given back is kept for the next request, never closed (an
    # overflow one was, so under load the API opened a Postgres backend on many requests).
    monkeypatch.setattr(db, "POOL_SIZE", 4)
    engine = db.make_engine(postgres_url)
    try:
        pool = engine.pool
        assert pool.size() == 4 and pool._max_overflow == 0  # type: ignore[attr-defined]
        held = [engine.connect() for _ in range(4)]
        pids = {conn.execute(text("SELECT pg_backend_pid()")).scalar_one() for conn in held}
        for conn in held:
            conn.close()
        assert pool.checkedin() == 4  # type: ignore[attr-defined]
        again = [engine.connect() for _ in range(4)]
        assert {c.execute(text("SELECT pg_backend_pid()")).scalar_one() for c in again} == pids
        for conn in again:
            conn.close()
    finally:
        engine.dispose()


def test_a_connection_that_died_while_pooled_is_replaced(postgres_url: str) -> None:
    engine = db.make_engine(postgres_url)
    try:
        pid = _backend_pid(engine)
        _terminate(postgres_url, pid)  # as a database restart would
        assert _backend_pid(engine) != pid  # pinged, found dead, replaced: no error
    finally:
        engine.dispose()
