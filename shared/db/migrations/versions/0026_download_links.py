"""``download_links``: short-lived links to one artifact of a job (``POST /jobs/{id}/downloads``),
for clients that cannot send the ``Authorization`` header with a download (a browser following a
link, ``wget``): the link's token is its key. Only the token's SHA-256 is stored, with the job, the
file's path, who made it and when it expires.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-08 02:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0026"
down_revision: str | Sequence[str] | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "download_links",
        sa.Column("token_hash", sa.String(length=64), primary_key=True),
        sa.Column("job_id", sa.Uuid(), sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("path", sa.String(length=1000), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False, index=True),
    )


def downgrade() -> None:
    op.drop_table("download_links")
