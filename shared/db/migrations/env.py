"""Alembic's migration environment for tuneq's tables (``SQLModel.metadata``).

Run through ``tuneq migrate``, ``shared.db.engine.migrate_database`` or ``alembic upgrade head`` (with
``alembic.ini`` at the repository root). The database is ``sqlalchemy.url`` when the config
sets it, else ``TUNEQ_DATABASE_URL`` (``shared.settings``). A caller may hand over an open
connection as ``config.attributes["connection"]``; it then holds the migration lock itself.
"""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy.engine import Connection, make_url
from sqlmodel import SQLModel

from shared.db import models  # noqa: F401  (registers the tables on SQLModel.metadata)
from shared.db.engine import make_migration_engine, migration_lock
from shared.settings import get_settings

config = context.config
if config.config_file_name is not None:  # the alembic command with alembic.ini: its loggers
    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = SQLModel.metadata


def _database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().database_url


def _options(dialect: str) -> dict[str, Any]:
    return {
        "target_metadata": target_metadata,
        "compare_type": True,
        # SQLite cannot ALTER most things: batch mode copies the table instead.
        "render_as_batch": dialect == "sqlite",
    }


def run_migrations_offline() -> None:
    """``alembic upgrade head --sql``: print the SQL instead of running it."""
    url = _database_url()
    context.configure(
        url=url, literal_binds=True, dialect_opts={"paramstyle": "named"}, **_options(make_url(url).get_backend_name())
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    context.configure(connection=connection, **_options(connection.dialect.name))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # the caller holds the migration lock
        _run(connection)
        return
    engine = make_migration_engine(_database_url())
    try:
        with engine.connect() as connection, migration_lock(connection):
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
