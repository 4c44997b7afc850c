"""Jobs' hub model revision; job events of type ``plan``; checkpoints of kind ``adapter``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 18:05:01.291991

The column comes from autogenerate. Enum values it does not see: Postgres stores the enums
as native types, which need the values added by hand; SQLite stores text and needs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# enum type: (table, column, values before, values added)
ENUM_VALUES = {
    "eventtype": (
        "job_events",
        "type",
        ("status", "metric", "checkpoint", "resumed", "warning", "log", "download"),
        ("plan",),
    ),
    "checkpointkind": ("checkpoints", "kind", ("deepspeed", "model"), ("adapter",)),
}


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("revision", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        for name, (_table, _column, _before, added) in ENUM_VALUES.items():
            for value in added:
                # Allowed in a transaction (Postgres 12+); the value is usable once this commits.
                op.execute(f"ALTER TYPE {name} ADD VALUE IF NOT EXISTS '{value}'")


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for name, (table, column, before, added) in ENUM_VALUES.items():
        # The older code cannot read these rows.
        op.execute(f"DELETE FROM {table} WHERE {column} IN ({', '.join(repr(v) for v in added)})")
        if postgres:
            # Postgres cannot drop an enum value: replace the type by one without it.
            op.execute(f"ALTER TYPE {name} RENAME TO {name}_old")
            op.execute(f"CREATE TYPE {name} AS ENUM ({', '.join(repr(v) for v in before)})")
            op.execute(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE {name} USING {column}::text::{name}")
            op.execute(f"DROP TYPE {name}_old")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("revision")
