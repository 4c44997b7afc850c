"""Pause and resume: job statuses ``pausing`` and ``paused``, and ``jobs.pauses`` (the attempts
that ended in a pause, which do not count against ``max_restarts``).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JOB_STATUSES_BEFORE = ("queued", "running", "cancelling", "succeeded", "failed", "cancelled")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # Each placed after a value that is already committed, in the order JobStatus lists them
        # (cancelling, pausing, paused): a value added in this transaction cannot be referred to.
        op.execute("ALTER TYPE jobstatus ADD VALUE IF NOT EXISTS 'paused' AFTER 'cancelling'")
        op.execute("ALTER TYPE jobstatus ADD VALUE IF NOT EXISTS 'pausing' AFTER 'cancelling'")
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("pauses", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    # The older code knows neither status. A pausing job keeps running (its pause request is
    # dropped); a paused one goes back to the queue, unpublished, so a reconciler publishes it
    # and it continues from its pause checkpoint like a requeued job: no job is lost or ended.
    op.execute("UPDATE jobs SET status = 'running' WHERE status = 'pausing'")
    op.execute("UPDATE jobs SET status = 'queued', enqueued_at = NULL WHERE status = 'paused'")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("pauses")
    if op.get_bind().dialect.name == "postgresql":
        # Postgres cannot drop an enum value: replace the type by one without them.
        op.execute("ALTER TYPE jobstatus RENAME TO jobstatus_old")
        op.execute(f"CREATE TYPE jobstatus AS ENUM ({', '.join(repr(v) for v in JOB_STATUSES_BEFORE)})")
        op.execute("ALTER TABLE jobs ALTER COLUMN status TYPE jobstatus USING status::text::jobstatus")
        op.execute("DROP TYPE jobstatus_old")
