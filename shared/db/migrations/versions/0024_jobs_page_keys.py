"""``GET /jobs``'s newest-first pages read from the index alone: ``ix_jobs_owner_created_at``
becomes ``ix_jobs_owner_created_at_id`` (owner, created_at, id), the page's whole order (id
breaks ties). A deep page (``skip=50000``) then skips index entries, not rows: the page's ids
come from an index-only scan and only its 50 rows are read (``api.jobs_service.list_jobs``;
B11a: 58.6 ms to ~15 ms at 100,000 jobs).

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-08 02:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0024"
down_revision: str | Sequence[str] | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_owner_created_at_id", "jobs", ["owner", "created_at", "id"])
    op.drop_index("ix_jobs_owner_created_at", table_name="jobs")


def downgrade() -> None:
    op.create_index("ix_jobs_owner_created_at", "jobs", ["owner", "created_at"])
    op.drop_index("ix_jobs_owner_created_at_id", table_name="jobs")
