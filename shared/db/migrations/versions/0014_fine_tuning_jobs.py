"""``jobs.fine_tuning`` (what a ``POST /v1/fine_tuning/jobs`` request said beyond the native
fields, and its resolved hyperparameters) and ``files.records`` (a file's records, counted at
upload).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 11:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("fine_tuning", sa.JSON(), nullable=True))
    # Files uploaded before: None, counted when a job first needs the number.
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("records", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("records")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("fine_tuning")
