"""artifacts: the files of each job published to the artifact store, with their SHA-256; job
events of type ``artifact``; job_events indexed on (job_id, id), so a job's newest events (a
log tail) are read without walking the events of every later job.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 06:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EVENT_TYPES_BEFORE = ("status", "metric", "checkpoint", "resumed", "warning", "log", "download", "plan")


def upgrade() -> None:
    op.create_table(
        "artifacts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("path", sqlmodel.sql.sqltypes.AutoString(length=1000), nullable=False),
        sa.Column("kind", sa.Enum("deepspeed", "model", "adapter", "log", name="artifactkind"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "path"),
    )
    op.create_index("ix_artifacts_job_id", "artifacts", ["job_id"])
    op.create_index("ix_job_events_job_id_id", "job_events", ["job_id", "id"])
    op.drop_index("ix_job_events_job_id", table_name="job_events")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TYPE eventtype ADD VALUE IF NOT EXISTS 'artifact'")


def downgrade() -> None:
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])
    op.drop_index("ix_job_events_job_id_id", table_name="job_events")
    op.drop_index("ix_artifacts_job_id", table_name="artifacts")
    op.drop_table("artifacts")
    op.execute("DELETE FROM job_events WHERE type = 'artifact'")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TYPE artifactkind")
        # Postgres cannot drop an enum value: replace the type by one without it.
        op.execute("ALTER TYPE eventtype RENAME TO eventtype_old")
        op.execute(f"CREATE TYPE eventtype AS ENUM ({', '.join(repr(v) for v in EVENT_TYPES_BEFORE)})")
        op.execute("ALTER TABLE job_events ALTER COLUMN type TYPE eventtype USING type::text::eventtype")
        op.execute("DROP TYPE eventtype_old")
