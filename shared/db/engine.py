"""Database engine and sessions, and the schema's migrations, for the API and the worker alike."""

from __future__ import annotations

import fcntl
import logging
import sqlite3
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event, inspect, text
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.pool import NullPool
from sqlmodel import Session, create_engine

from shared.db import models  # noqa: F401  (registers the tables on SQLModel.metadata)
from shared.settings import Settings, get_settings

logger = logging.getLogger(__name__)

# The migration environment ships inside the package (shared/db/migrations), so an installed
# `tuneq` migrates without the repository's alembic.ini.
MIGRATIONS_LOCATION = "shared.db:migrations"
# The first revision: the schema tuneq created with `create_all` before it had migrations.
INITIAL_REVISION = "0001"
# pg_advisory_lock key (per database) that serializes migrators: "tuneq-migrations".
MIGRATION_LOCK_KEY = zlib.crc32(b"tuneq-migrations")


# Connections a process keeps (and uses at most) to a server database.
POOL_SIZE = 30
CONNECT_TIMEOUT_SECONDS = 5
SQLITE_BUSY_SECONDS = 30  # how long an SQLite connection waits for another's lock


class DatabaseNotMigrated(RuntimeError):
    """The database's schema is not at the revision this tuneq needs; the message says what to run."""


def _sqlite_journal(dbapi_connection: Any, _record: Any) -> None:
    # The API and the worker are separate processes writing one file: WAL lets readers go on
    # while the worker writes a metric batch, and the busy timeout makes writers wait, not fail.
    # synchronous=NORMAL, SQLite's advice for WAL: a commit no longer waits for an fsync (a few
    # ms each on a laptop's disk, for every metric batch, event and lease renewal), and the
    # database stays consistent through a crash; a power cut may lose the last commits, which
    # the worker's lease and the reconciler already treat as a lost attempt.
    cursor = dbapi_connection.cursor()
    _switch_to_wal(cursor)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _switch_to_wal(cursor: Any) -> None:
    # Connections switching a new database to WAL at the same moment (an API and a worker
    # started together) both hold its shared lock and want the exclusive one: SQLite refuses
    # one at once, "database is locked", without the busy wait that would break no deadlock.
    # The one refused tries again once the other has switched (the mode is then the file's).
    deadline = time.monotonic() + SQLITE_BUSY_SECONDS
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _sqlite_foreign_keys(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_SECONDS})
        event.listen(engine, "connect", _sqlite_journal)
        event.listen(engine, "connect", _sqlite_foreign_keys)
        return engine
    # At most 30 connections a process, as before (10 kept + 20 overflow), but all of them kept:
    # an overflow connection is closed when it goes back to the pool, so the API under load
    # (up to 40 request threads) opened and closed a Postgres connection (a backend process)
    # on many requests. Connections are still opened only when needed, so a process that uses
    # few keeps few; one that had a burst keeps up to 30 idle (was 10): the peak is unchanged.
    # pool_pre_ping: a connection that died while pooled (a database restart) is replaced
    # instead of failing a request or a worker's write.
    # connect_timeout: a database host that drops packets fails a connection attempt in
    # seconds (then retried as a transient error), instead of hanging a request or a worker.
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=POOL_SIZE,
        max_overflow=0,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_SECONDS},
    )


@lru_cache
def get_engine() -> Engine:
    return make_engine(get_settings().database_url)


def get_read_engine() -> Engine:
    """The process's engine in autocommit, on the same pool, for requests that only read.

    A read in a transaction costs three round trips (BEGIN, the SELECT, the ROLLBACK when the
    connection goes back to the pool); in autocommit it is the SELECT alone, and returning the
    connection does no I/O. Each statement sees its own snapshot, which is all a single read
    needs."""
    return _autocommit(get_engine())


@lru_cache(maxsize=4)
def _autocommit(engine: Engine) -> Engine:
    return engine.execution_options(isolation_level="AUTOCOMMIT")


@contextmanager
def session_scope() -> Iterator[Session]:
    with Session(get_engine(), expire_on_commit=False) as session:
        yield session


def is_transient_database_error(error: BaseException) -> bool:
    """Whether ``error`` says the database is restarting, unreachable or busy (worth retrying,
    and nobody's mistake) rather than that a statement is wrong. A restart shows up as
    ``AdminShutdown`` on the connections it ended, ``connection refused`` while it is down."""
    if isinstance(error, OperationalError | InterfaceError):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


# ---- migrations ------------------------------------------------------------------------


def _url_string(url: str | URL) -> str:
    return url if isinstance(url, str) else url.render_as_string(hide_password=False)


def display_url(url: str | URL) -> str:
    """The URL with its password hidden, for messages."""
    return make_url(url).render_as_string(hide_password=True)


def alembic_config(url: str | URL | None = None) -> Config:
    """An Alembic config for tuneq's migrations, without an ini file.

    Without ``url`` the migration environment uses ``TUNEQ_DATABASE_URL`` (the settings).
    """
    config = Config()
    config.set_main_option("script_location", MIGRATIONS_LOCATION)
    config.set_main_option("path_separator", "os")
    if url is not None:
        config.set_main_option("sqlalchemy.url", _url_string(url).replace("%", "%%"))  # ini interpolation
    return config


@lru_cache
def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revisions() -> tuple[str, ...]:
    return tuple(sorted(script_directory().get_heads()))


def current_revisions(connection: Connection) -> tuple[str, ...]:
    return tuple(sorted(MigrationContext.configure(connection).get_current_heads()))


def make_migration_engine(url: str | URL) -> Engine:
    """A one-connection engine for running migrations.

    On SQLite foreign keys stay off (SQLite's default): batch migrations copy a table and
    drop the original, which other tables reference. The journal is the app's (WAL, no fsync
    per commit): a migration to head commits once per revision.
    """
    if make_url(url).get_backend_name() == "sqlite":
        engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": SQLITE_BUSY_SECONDS})
        event.listen(engine, "connect", _sqlite_journal)
        return engine
    return create_engine(url, poolclass=NullPool)


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if url.get_backend_name() != "sqlite" or not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


@contextmanager
def migration_lock(connection: Connection) -> Iterator[None]:
    """Hold the lock that serializes migrators of this database (processes started together).

    Postgres: a session-level advisory lock on ``connection``. SQLite: an exclusive ``flock``
    on a file next to the database (SQLite runs DDL outside transactions, so it cannot lock
    for us). The connection is left outside a transaction on entry.
    """
    dialect = connection.dialect.name
    if dialect == "postgresql":
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        connection.commit()
        try:
            yield
        finally:
            connection.rollback()
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
            connection.commit()
        return
    database = _sqlite_file(connection.engine.url) if dialect == "sqlite" else None
    if database is None:
        yield
        return
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.migrate-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _predates_migrations(connection: Connection) -> bool:
    """Tables created by a tuneq from before migrations (``create_all``), without a revision."""
    inspector = inspect(connection)
    return inspector.has_table("jobs") and not inspector.has_table("alembic_version")


def _columns(connection: Connection) -> dict[str, set[str]]:
    inspector = inspect(connection)
    return {
        table: {column["name"] for column in inspector.get_columns(table)}
        for table in inspector.get_table_names()
        if table != "alembic_version"
    }


@lru_cache
def _initial_columns() -> dict[str, set[str]]:
    """Each table's columns at the first revision, from a scratch SQLite database migrated to it."""
    with tempfile.TemporaryDirectory(prefix="tuneq-initial-schema-") as scratch:
        url = f"sqlite:///{Path(scratch) / 'initial.sqlite'}"
        command.upgrade(alembic_config(url), INITIAL_REVISION)
        engine = make_migration_engine(url)
        try:
            with engine.connect() as connection:
                return _columns(connection)
        finally:
            engine.dispose()


def _adoption_problem(connection: Connection, url: URL) -> str | None:
    """Why tables from before migrations cannot be stamped with the first revision, if they cannot."""
    found, expected = _columns(connection), _initial_columns()
    missing = sorted(f"{t}.{c}" for t, columns in expected.items() for c in columns - found.get(t, set()))
    unknown = sorted(f"{t}.{c}" for t, columns in found.items() if t in expected for c in columns - expected[t])
    if connection.dialect.name == "postgresql":  # and the enum types' values (SQLite stores text)
        initial_enums: dict[str, tuple[str, ...]] = script_directory().get_revision(INITIAL_REVISION).module.ENUMS
        found_enums = {e["name"]: tuple(e["labels"]) for e in inspect(connection).get_enums()}  # type: ignore[attr-defined]
        missing += [
            f"enum {name} values {values}" for name, values in initial_enums.items() if found_enums.get(name) != values
        ]
    if not missing and not unknown:
        return None
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing)}")
    if unknown:
        parts.append(f"unknown {', '.join(unknown)}")
    differences = "; ".join(parts)
    sqlite_file = _sqlite_file(url)
    fix = f"remove {sqlite_file} (the embedded database) and start again" if sqlite_file else "recreate it"
    return (
        f"the database at {display_url(url)} was created before tuneq had migrations, by a tuneq with "
        f"another schema ({differences}), so it cannot be adopted as revision {INITIAL_REVISION}: {fix}, "
        "or alter its tables to match and run `tuneq migrate`"
    )


def _unknown_revision_problem(url: URL, current: tuple[str, ...]) -> str | None:
    known = {script.revision for script in script_directory().walk_revisions()}
    unknown = [revision for revision in current if revision not in known]
    if not unknown:
        return None
    return (
        f"the database at {display_url(url)} is at revision {', '.join(unknown)}, which this tuneq does not "
        f"know (head is {', '.join(head_revisions())}): a newer tuneq migrated it; run that version"
    )


def migrate_database(url: str | URL | None = None) -> str:
    """Upgrade the database (default: the settings' ``database_url``) to the newest revision.

    Safe to run from several processes at once: they take turns (``migration_lock``), and
    the later ones find nothing left to do. A database whose tables a tuneq from before
    migrations created is stamped with the first revision (if its columns are that revision's;
    else ``DatabaseNotMigrated`` says what differs), then upgraded. Returns the database's
    revision afterwards.
    """
    url = make_url(url or get_settings().database_url)
    sqlite_file = _sqlite_file(url)
    if sqlite_file is not None:
        sqlite_file.parent.mkdir(parents=True, exist_ok=True)
    engine = make_migration_engine(url)
    try:
        with engine.connect() as connection, migration_lock(connection):
            heads = head_revisions()
            current = current_revisions(connection)
            predates = not current and _predates_migrations(connection)
            # Each Alembic command below runs, and commits, its own transaction on this connection.
            connection.commit()
            if current != heads:
                unknown = _unknown_revision_problem(url, current)
                if unknown is not None:
                    raise DatabaseNotMigrated(unknown)
                config = alembic_config(url)
                config.attributes["connection"] = connection
                if predates:
                    problem = _adoption_problem(connection, url)
                    connection.commit()
                    if problem is not None:
                        raise DatabaseNotMigrated(problem)
                    logger.info("adopting the tables at %s: stamping revision %s", display_url(url), INITIAL_REVISION)
                    command.stamp(config, INITIAL_REVISION)
                logger.info("migrating the database at %s to %s", display_url(url), ", ".join(heads))
                command.upgrade(config, "head")
                current = current_revisions(connection)
                connection.commit()
            return ", ".join(current)
    finally:
        engine.dispose()


def database_revision_problem(engine: Engine | None = None) -> str | None:
    """None when the database is at the newest revision; else what is wrong and what to run."""
    engine = engine or get_engine()
    with engine.connect() as connection:
        current = current_revisions(connection)
        predates = not current and _predates_migrations(connection)
    heads = head_revisions()
    if current == heads:
        return None
    where = f"the database at {display_url(engine.url)}"
    head = ", ".join(heads)
    if predates:
        return (
            f"{where} was created before tuneq had migrations (no revision, head is {head}): "
            "run `tuneq migrate`, which adopts and upgrades it"
        )
    unknown = _unknown_revision_problem(engine.url, current)
    if unknown is not None:
        return unknown
    at = ", ".join(current) or "none"
    return (
        f"{where} is not migrated (at revision {at}, head is {head}): run `tuneq migrate` (or `alembic upgrade head`)"
    )


def init_db(settings: Settings | None = None, engine: Engine | None = None) -> None:
    """Make the database ready for the API or a worker, before either serves.

    The embedded default (SQLite) migrates itself (processes started together take turns).
    Any other database must have been migrated beforehand (``tuneq migrate``): this checks
    and raises ``DatabaseNotMigrated`` with the message saying what to run.
    """
    settings = settings or get_settings()
    settings.ensure_dirs()
    url = engine.url if engine is not None else make_url(settings.database_url)
    if url.get_backend_name() == "sqlite":
        migrate_database(url)
        return
    problem = database_revision_problem(engine)
    if problem is not None:
        raise DatabaseNotMigrated(problem)
