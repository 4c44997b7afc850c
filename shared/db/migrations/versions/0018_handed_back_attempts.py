"""``jobs.handbacks``: the attempts a worker handed back because it was asked to stop (a deploy,
a scale-down), which, like pauses, do not count against ``max_restarts``.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07 18:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("handbacks", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    # The older code counts every attempt but pauses against max_restarts: a job handed back
    # more often than that would fail at its next loss, which is what it did before.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("handbacks")
