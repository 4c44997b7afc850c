"""Indexes for ``GET /jobs``'s pages: an owner's jobs newest first (``ix_jobs_owner_created_at``),
of one status (``ix_jobs_owner_status_created_at``), or by name (``ix_jobs_owner_name``). With
100,000 jobs each page, and its count, is an index range instead of a scan and a sort.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07 21:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0022"
down_revision: str | Sequence[str] | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {
    "ix_jobs_owner_created_at": ["owner", "created_at"],
    "ix_jobs_owner_status_created_at": ["owner", "status", "created_at"],
    "ix_jobs_owner_name": ["owner", "name"],
}


def upgrade() -> None:
    for name, columns in INDEXES.items():
        op.create_index(name, "jobs", columns)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="jobs")
