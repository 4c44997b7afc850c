"""The Postgres pool: every connection kept (no overflow churn), a dead one replaced; the
embedded SQLite's connection settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from psycopg.pq import TransactionStatus
from sqlalchemy import Engine, text

from shared.db import engine as db


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


def test_reads_share_the_pool_without_a_transaction(postgres_url: str) -> None:
    # The read engine (GET routes) runs each statement on its own: no BEGIN before it, no
    # ROLLBACK when the connection goes back, and the pool is the same connections.
    engine = db.make_engine(postgres_url)
    try:
        reads = db._autocommit(engine)
        assert reads is db._autocommit(engine) and reads.pool is engine.pool
        with reads.connect() as conn:
            conn.execute(text("SELECT 1"))
            assert conn.connection.dbapi_connection.info.transaction_status == TransactionStatus.IDLE  # type: ignore[union-attr]
        with engine.connect() as conn:  # the same connection, in a transaction again for writers
            conn.execute(text("SELECT 1"))
            assert conn.connection.dbapi_connection.info.transaction_status == TransactionStatus.INTRANS  # type: ignore[union-attr]
    finally:
        engine.dispose()


def _sqlite_settings(engine: Engine) -> dict[str, object]:
    try:
        with engine.connect() as conn:
            return {
                name: conn.execute(text(f"PRAGMA {name}")).scalar_one()
                for name in ("journal_mode", "synchronous", "foreign_keys")
            }
    finally:
        engine.dispose()


def test_an_sqlite_connection_writes_ahead_and_commits_without_waiting_for_the_disk(tmp_path: Path) -> None:
    # WAL (readers beside a writer), synchronous=NORMAL (no fsync per commit), foreign keys on.
    app = _sqlite_settings(db.make_engine(f"sqlite:///{tmp_path / 'tuneq.sqlite'}"))
    assert app == {"journal_mode": "wal", "synchronous": 1, "foreign_keys": 1}  # 1: NORMAL (FULL is 2)
    # Migrations (of a new database too) commit the same way, with foreign keys off for batch copies.
    migrator = _sqlite_settings(db.make_migration_engine(f"sqlite:///{tmp_path / 'new.sqlite'}"))
    assert migrator == {"journal_mode": "wal", "synchronous": 1, "foreign_keys": 0}


def test_connections_opening_a_new_sqlite_database_together_all_switch_it_to_wal(tmp_path: Path) -> None:
    """Two connections switching a new database to WAL at once: SQLite refuses one of them at
    once ("database is locked", without its busy wait: both hold the shared lock and want the
    exclusive one). An API and a worker started together hit it; each must wait its turn."""
    import sqlite3
    import threading

    for trial in range(30):  # a race: about one trial in three lost it without the retry
        path = tmp_path / f"tuneq-{trial}.sqlite"
        sqlite3.connect(path).close()  # a new database, not yet in WAL
        engines = [db.make_engine(f"sqlite:///{path}") for _ in range(4)]
        together = threading.Barrier(len(engines))
        failures: list[BaseException] = []

        def connect(engine: Engine, together: threading.Barrier, failures: list[BaseException]) -> None:
            together.wait()
            try:
                with engine.connect() as conn:
                    conn.execute(text("SELECT 1"))
            except Exception as e:
                failures.append(e)

        threads = [threading.Thread(target=connect, args=(engine, together, failures)) for engine in engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for engine in engines:
            engine.dispose()
        assert failures == [], failures
        assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)
