"""The initial schema: the tables tuneq created with ``create_all`` before it had migrations.

Revision ID: 0001
Revises:
Create Date: 2026-12-02 17:47:03.433136

Made with ``alembic revision --autogenerate`` against an empty database, then tidied:
plain ``sa.String`` for SQLModel's ``AutoString`` (the same DDL), indexes created directly
on the new tables, and the Postgres enum types dropped on downgrade. Enums are stored as
SQLAlchemy's ``Enum`` stores them, as SQLModel declares them: a native ``ENUM`` type on
Postgres, ``VARCHAR`` (no CHECK constraint) on SQLite. Constraints keep the database's
default names, as ``create_all`` left them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The values as they are today; later changes to the Python enums need their own migration.
ENUMS = {
    "jobstatus": ("queued", "running", "cancelling", "succeeded", "failed", "cancelled"),
    "eventtype": ("status", "metric", "checkpoint", "resumed", "warning", "log", "download"),
    "checkpointkind": ("deepspeed", "model"),
}


def _enum(name: str) -> sa.Enum:
    return sa.Enum(*ENUMS[name], name=name)  # a new one per use: a type object belongs to one table


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("status", _enum("jobstatus"), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("dataset", sa.String(), nullable=False),
        sa.Column("validation_dataset", sa.String(), nullable=True),
        sa.Column("dataset_stats", sa.JSON(), nullable=True),
        sa.Column("deepspeed_config", sa.JSON(), nullable=False),
        sa.Column("resolved_deepspeed_config", sa.JSON(), nullable=True),
        sa.Column("num_gpus", sa.Integer(), nullable=False),
        sa.Column("training", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=True),
        sa.Column("latest_metrics", sa.JSON(), nullable=True),
        sa.Column("epoch", sa.Float(), nullable=True),
        sa.Column("tokens_seen", sa.Integer(), nullable=False),
        sa.Column("eta_seconds", sa.Float(), nullable=True),
        sa.Column("error_code", sa.String(), nullable=True),
        sa.Column("error_message", sa.String(), nullable=True),
        sa.Column("worker_id", sa.String(), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_restarts", sa.Integer(), nullable=False),
        sa.Column("events_offset", sa.Integer(), nullable=False),
        sa.Column("log_offset", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("request_fingerprint", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("idempotency_key"),
    )
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_jobs_lease_expires_at", "jobs", ["lease_expires_at"])
    op.create_index("ix_jobs_status", "jobs", ["status"])

    op.create_table(
        "workers",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("hostname", sa.String(), nullable=False),
        sa.Column("accelerator", sa.String(), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("idle_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_workers_last_seen_at", "workers", ["last_seen_at"])

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", _enum("checkpointkind"), nullable=False),
        sa.Column("uri", sa.String(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "step", "kind"),
    )
    op.create_index("ix_checkpoints_job_id", "checkpoints", ["job_id"])

    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("type", _enum("eventtype"), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])

    op.create_table(
        "job_metrics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("learning_rate", sa.Float(), nullable=True),
        sa.Column("grad_norm", sa.Float(), nullable=True),
        sa.Column("epoch", sa.Float(), nullable=True),
        sa.Column("tokens_per_second", sa.Float(), nullable=True),
        sa.Column("samples_per_second", sa.Float(), nullable=True),
        sa.Column("real_token_share", sa.Float(), nullable=True),
        sa.Column("eval_loss", sa.Float(), nullable=True),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "step"),
    )
    op.create_index("ix_job_metrics_job_id", "job_metrics", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_job_metrics_job_id", table_name="job_metrics")
    op.drop_table("job_metrics")
    op.drop_index("ix_job_events_job_id", table_name="job_events")
    op.drop_table("job_events")
    op.drop_index("ix_checkpoints_job_id", table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_index("ix_workers_last_seen_at", table_name="workers")
    op.drop_table("workers")
    op.drop_index("ix_jobs_status", table_name="jobs")
    op.drop_index("ix_jobs_lease_expires_at", table_name="jobs")
    op.drop_index("ix_jobs_created_at", table_name="jobs")
    op.drop_table("jobs")
    # Dropping a table leaves its Postgres enum types behind (SQLite has none).
    bind = op.get_bind()
    for name in ENUMS:
        _enum(name).drop(bind, checkfirst=True)
