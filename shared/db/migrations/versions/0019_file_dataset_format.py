"""``files.dataset_format``: what an uploaded file's records are, ``messages`` (OpenAI's chat
fine-tuning format) or ``preference`` (its DPO format), as the check at upload found, so a job
whose method cannot train on them is refused at submit. Files uploaded before it hold chat records.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-08 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("dataset_format", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=True))


def downgrade() -> None:
    # The older code reads every file as chat records: a job on a DPO file fails as invalid_input
    # when its worker reads the first line, which names the line. The files themselves are kept.
    with op.batch_alter_table("files") as batch:
        batch.drop_column("dataset_format")
