"""Idempotency keys unique per owner; one Celery queue per worker size (jobs.queue, workers.queue).

Two teams may pick the same idempotency key. A job records the queue it was published to and
a worker the queue it consumes, so the reconciler can tell a lost message from a waiting one.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 08:55:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The first schema left the constraint unnamed: Postgres named it after the column, SQLite not
# at all. Batch mode reflects SQLite's under this convention's name so it can be dropped.
NAMING = {"uq": "%(table_name)s_%(column_0_name)s_key"}
OLD, NEW = "jobs_idempotency_key_key", "uq_jobs_owner_idempotency_key"


def upgrade() -> None:
    with op.batch_alter_table("jobs", naming_convention=NAMING) as batch_op:
        batch_op.drop_constraint(OLD, type_="unique")
        batch_op.create_unique_constraint(NEW, ["owner", "idempotency_key"])
        batch_op.add_column(sa.Column("queue", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))
    with op.batch_alter_table("workers") as batch_op:
        batch_op.add_column(sa.Column("queue", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch_op:
        batch_op.drop_column("queue")
    # Fails, as it should, where two owners already share a key.
    with op.batch_alter_table("jobs", naming_convention=NAMING) as batch_op:
        batch_op.drop_column("queue")
        batch_op.drop_constraint(NEW, type_="unique")
        batch_op.create_unique_constraint(OLD, ["idempotency_key"])
