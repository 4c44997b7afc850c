"""``api_keys.admin``: a key whose holder sees every owner's jobs (``tuneq keys create --admin``):
``GET /jobs`` lists them all (``?owner=`` narrows it), and their pages, metrics, logs and
artifacts answer it; it may cancel, pause and resume them. Every existing key is not an admin's.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-08 01:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0025"
down_revision: str | Sequence[str] | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    # The older code knows no admins: an admin's key becomes its owner's plain key.
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("admin")
