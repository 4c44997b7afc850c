"""multi-node jobs: ``jobs.num_nodes``, the ``job_nodes`` of each attempt of a gang, each node's
share of a checkpoint until all are uploaded (``checkpoint_uploads``), and each worker's
advertised address and the gang it is kept for.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 08:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_nodes",
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("worker_id", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.Column("address", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=False),
        sa.Column("port", sa.Integer(), nullable=True),
        sa.Column("state", sa.Enum("reserved", "running", "finished", "released", name="nodestate"), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error_message", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("job_id", "attempt", "node_rank"),
    )
    op.create_table(
        "checkpoint_uploads",
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("uri", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("files", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("job_id", "attempt", "step", "node_rank"),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("num_nodes", sa.Integer(), server_default="1", nullable=False))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("address", sqlmodel.sql.sqltypes.AutoString(length=200), nullable=True))
        batch.add_column(sa.Column("gang_job_id", sa.Uuid(), nullable=True))
        batch.create_index("ix_workers_gang_job_id", ["gang_job_id"])


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_index("ix_workers_gang_job_id")
        batch.drop_column("gang_job_id")
        batch.drop_column("address")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("num_nodes")
    op.drop_table("checkpoint_uploads")
    op.drop_table("job_nodes")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TYPE nodestate")
