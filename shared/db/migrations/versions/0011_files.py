"""files: the files uploaded through the OpenAI-compatible API (``POST /v1/files``), one row per
file (owner, name, purpose, size, SHA-256); the bytes themselves are in the artifact store under
``files/<id>``, which a downgrade leaves there.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 08:21:12.275121
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("filename", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=False),
        sa.Column("purpose", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_files_owner", "files", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_files_owner", table_name="files")
    op.drop_table("files")
