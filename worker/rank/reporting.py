"""How the training processes talk to the worker: an append-only events file and error files."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from pydantic import BaseModel

from shared.jobs.events import RankError
from shared.jobs.run_layout import RunLayout, write_json_atomic
from shared.jobs.status import ErrorCode


class EventWriter:
    """Rank 0 appends one JSON line per event and flushes, so the worker sees it at once."""

    def __init__(self, path: Path, *, enabled: bool) -> None:
        self._file: IO[str] | None = path.open("a", encoding="utf-8") if enabled else None

    def emit(self, event: BaseModel) -> None:
        if self._file is not None:
            self._file.write(event.model_dump_json() + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def write_rank_error(layout: RunLayout, *, rank: int, code: ErrorCode, message: str) -> None:
    error = RankError(rank=rank, code=code, message=message, time=datetime.now(UTC).isoformat())
    write_json_atomic(layout.errors_dir / f"rank-{rank}.json", json.loads(error.model_dump_json()))


def write_paused(layout: RunLayout, *, attempt: int, step: int) -> None:
    """Tell the worker the ranks stopped for a pause, with their checkpoint at ``step``."""
    write_json_atomic(layout.paused_marker(attempt), {"step": step})
