"""``workers.device_memory_bytes`` and ``workers.bf16_supported``: the memory of a worker's
smallest device (on a CPU worker, the host's) and whether its devices compute in bf16 natively,
for the DeepSpeed config tuneq chooses.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Rows of running workers stay NULL until they register again (the chooser then falls back
    # to TUNEQ_DEVICE_MEMORY_GIB and bf16).
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("device_memory_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("bf16_supported", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("bf16_supported")
        batch.drop_column("device_memory_bytes")
