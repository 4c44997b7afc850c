"""64-bit byte counts and offsets: checkpoints of large models and long logs pass 2 GiB.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 18:14:50.552247
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes  # noqa: F401  (autogenerate writes sqlmodel.sql.sqltypes.AutoString)
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.alter_column("bytes", existing_type=sa.INTEGER(), type_=sa.BigInteger(), existing_nullable=False)

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column("tokens_seen", existing_type=sa.INTEGER(), type_=sa.BigInteger(), existing_nullable=False)
        batch_op.alter_column(
            "events_offset", existing_type=sa.INTEGER(), type_=sa.BigInteger(), existing_nullable=False
        )
        batch_op.alter_column("log_offset", existing_type=sa.INTEGER(), type_=sa.BigInteger(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column("log_offset", existing_type=sa.BigInteger(), type_=sa.INTEGER(), existing_nullable=False)
        batch_op.alter_column(
            "events_offset", existing_type=sa.BigInteger(), type_=sa.INTEGER(), existing_nullable=False
        )
        batch_op.alter_column("tokens_seen", existing_type=sa.BigInteger(), type_=sa.INTEGER(), existing_nullable=False)

    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.alter_column("bytes", existing_type=sa.BigInteger(), type_=sa.INTEGER(), existing_nullable=False)
