"""Processes started together (an API and workers) migrate the embedded database and create
the broker queue without tripping over each other (tests/shared/db/test_migrations.py checks the
migrated schema)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.together import run_together

SETUP = "from shared.db.engine import init_db; from shared.queue import declare_embedded_queue"
STARTUP = "init_db(); declare_embedded_queue('tuneq-2gpu')"


def test_concurrent_first_starts_all_succeed(tmp_path: Path) -> None:
    for round_ in range(3):
        home = tmp_path / f"home{round_}"
        env = {**os.environ, "TUNEQ_HOME": str(home)}
        for var in ("TUNEQ_DATABASE_URL", "TUNEQ_BROKER_URL"):
            env.pop(var, None)
        run_together(SETUP, STARTUP, env=env, n=4)
