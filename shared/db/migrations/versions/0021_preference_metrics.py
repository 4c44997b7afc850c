"""Preference tuning (DPO): ``job_metrics`` gains TRL's DPO measures (``rewards_chosen``,
``rewards_rejected``, ``rewards_accuracies``, ``rewards_margins``, ``logps_chosen``,
``logps_rejected``, ``logits_chosen``, ``logits_rejected``, ``eval_rewards_accuracies``; null for an
SFT job's steps), job events of type ``phase`` (work before the first step, with its progress: the
reference log-probabilities of a DPO job), and ``jobs.phase``, the latest such event's progress.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-08 12:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0021"
down_revision: str | Sequence[str] | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PREFERENCE_MEASURES = (
    "rewards_chosen",
    "rewards_rejected",
    "rewards_accuracies",
    "rewards_margins",
    "logps_chosen",
    "logps_rejected",
    "logits_chosen",
    "logits_rejected",
    "eval_rewards_accuracies",
)
EVENT_TYPES_BEFORE = ("status", "metric", "checkpoint", "resumed", "warning", "log", "download", "plan", "artifact")


def upgrade() -> None:
    with op.batch_alter_table("job_metrics") as batch:
        for name in PREFERENCE_MEASURES:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("phase", sa.JSON(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TYPE eventtype ADD VALUE IF NOT EXISTS 'phase'")


def downgrade() -> None:
    # A DPO job's steps keep their loss, learning rate and the rest; their DPO measures and the
    # phase events go with their columns and rows.
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("phase")
    with op.batch_alter_table("job_metrics") as batch:
        for name in reversed(PREFERENCE_MEASURES):
            batch.drop_column(name)
    op.execute("DELETE FROM job_events WHERE type = 'phase'")
    if op.get_bind().dialect.name == "postgresql":
        # Postgres cannot drop an enum value: replace the type by one without it.
        op.execute("ALTER TYPE eventtype RENAME TO eventtype_old")
        op.execute(f"CREATE TYPE eventtype AS ENUM ({', '.join(repr(v) for v in EVENT_TYPES_BEFORE)})")
        op.execute("ALTER TABLE job_events ALTER COLUMN type TYPE eventtype USING type::text::eventtype")
        op.execute("DROP TYPE eventtype_old")
