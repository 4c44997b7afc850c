"""``jobs.model_source``: what a job whose ``model`` names another job's output (``job:<id>``,
``job:<id>@step-<n>``, an ``ft:`` name) was resolved to at submit: that job, the kind of output
(its exported model or adapter, or a DeepSpeed checkpoint), the step, and the base model the chain
started from (``shared.jobs.model_source.ModelSource``). Null for a job on a base model.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07 18:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0020"
down_revision: str | Sequence[str] | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("model_source", sa.JSON(), nullable=True))


def downgrade() -> None:
    # The older code takes a job's model as a hub id or a directory: a queued job whose model is
    # job:<id> or an ft: name fails as invalid_input when a worker cannot load it. Succeeded
    # jobs keep their model as they named it, and what they made.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("model_source")
