"""job_metrics loses its index on job_id alone: the unique (job_id, step) index serves every query.

Every metric row paid for both indexes as it was written, and the worker writes one per
optimizer step of every job; a lookup by job_id uses the leading column of (job_id, step).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 03:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index("ix_job_metrics_job_id", table_name="job_metrics")


def downgrade() -> None:
    op.create_index("ix_job_metrics_job_id", "job_metrics", ["job_id"])
