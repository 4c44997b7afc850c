"""Trigram indexes for ``GET /jobs?model=…`` and ``?name=…`` on Postgres: their part-of matches
(``ILIKE '%…%'``) read every row of the owner without one (B11a: ~0.2 s a page at 100,000 jobs).
With ``ix_jobs_model_trgm`` and ``ix_jobs_name_trgm`` (GIN, ``pg_trgm``'s ``gin_trgm_ops``)
Postgres reads only the rows whose trigrams match. SQLite cannot use an index for them: there
the two are empty (``WHERE false``), so both databases have models.py's schema.

The indexes need the ``pg_trgm`` extension (in PostgreSQL's contrib, trusted: a database's owner
may create it). It is created when the database has none, in ``public`` where that is allowed
(an extension lives in one schema, and is dropped with it), else in the current schema; the
operator class is named with the schema it is in. The downgrade drops the indexes and leaves
the extension, which other schemas may use.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07 22:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0023"
down_revision: str | Sequence[str] | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {"ix_jobs_model_trgm": "model", "ix_jobs_name_trgm": "name"}
EXTENSION_SCHEMA = sa.text(
    "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'pg_trgm'"
)


def _trigram_schema(bind: sa.engine.Connection) -> str:
    """The schema of the database's ``pg_trgm``, created first when there is none."""
    schema = bind.execute(EXTENSION_SCHEMA).scalar()
    if schema is not None:
        return str(schema)
    public = bind.execute(  # None without a public schema
        sa.text("SELECT has_schema_privilege(current_user, oid, 'CREATE') FROM pg_namespace WHERE nspname = 'public'")
    ).scalar()
    try:
        bind.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_trgm" + (" SCHEMA public" if public else "")))
    except sa.exc.DBAPIError as e:
        raise RuntimeError(
            "migration 0023 needs PostgreSQL's pg_trgm extension for the jobs list's model and name filters: "
            "install PostgreSQL's contrib package on the database server, or have a superuser run "
            f"`CREATE EXTENSION pg_trgm;` in this database, then migrate again ({e.orig})"
        ) from e
    return str(bind.execute(EXTENSION_SCHEMA).scalar_one())


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        # SQLite cannot use an index for a part-of match: an empty one (WHERE false), so that the
        # schema is models.py's on both databases and no write pays for it.
        for name, column in INDEXES.items():
            op.create_index(name, "jobs", [column], sqlite_where=sa.false())
        return
    schema = _trigram_schema(bind)
    for name, column in INDEXES.items():
        op.create_index(
            name, "jobs", [column], postgresql_using="gin", postgresql_ops={column: f'"{schema}".gin_trgm_ops'}
        )


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="jobs")
