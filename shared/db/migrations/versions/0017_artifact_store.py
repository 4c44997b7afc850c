"""artifact_store: the one artifact store a deployment's processes share, named by the marker the
first of them wrote into it (shared.db.store_identity); a process whose store lacks that marker
refuses to start. A downgrade leaves the marker in the store.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-08 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Empty until the first `tuneq serve`, `worker` or `dev` after the upgrade records its store.
    op.create_table(
        "artifact_store",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("store_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("uri", sqlmodel.sql.sqltypes.AutoString(length=2000), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("artifact_store")
