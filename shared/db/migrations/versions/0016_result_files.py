"""``files.job_id``: a file that is a job's results (purpose ``fine-tune-results``, the per-step
metrics the worker writes as CSV when the job succeeds), OpenAI's ``result_files``.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 11:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("job_id", sa.Uuid(), nullable=True))
        batch.create_index("ix_files_job_id", ["job_id"])


def downgrade() -> None:
    # The results files' rows go with the column: their bytes stay in the store, reachable by nothing.
    op.execute(sa.text("DELETE FROM files WHERE job_id IS NOT NULL"))
    with op.batch_alter_table("files") as batch:
        batch.drop_index("ix_files_job_id")
        batch.drop_column("job_id")
