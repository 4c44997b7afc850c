"""``jobs.deepspeed_config_chosen``: the job's DeepSpeed config is the one tuneq chose for a
request that named none.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every job before this one brought its own config.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("deepspeed_config_chosen", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("deepspeed_config_chosen")
