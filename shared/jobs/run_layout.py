"""Where a run's files live. One layout, used by the worker that writes and the API that reads."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from shared.settings import Settings


@dataclass(frozen=True)
class RunLayout:
    """``$TUNEQ_HOME/runs/<job id>/`` and everything in it."""

    root: Path

    @classmethod
    def for_job(cls, settings: Settings, job_id: uuid.UUID | str) -> RunLayout:
        return cls(settings.runs_dir / str(job_id))

    @property
    def spec(self) -> Path:
        return self.root / "spec.json"

    def events(self, attempt: int) -> Path:
        """JSON Lines that rank 0 appends and the worker tails; one file per attempt, so a
        resumed attempt never re-reads what a lost one wrote."""
        return self.root / f"events-{attempt}.jsonl"

    @property
    def log(self) -> Path:
        """Everything the launcher and the ranks print."""
        return self.root / "train.log"

    @property
    def errors_dir(self) -> Path:
        """One JSON file per rank that failed, with the exception that ended it."""
        return self.root / "errors"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def heartbeat(self, rank: int) -> Path:
        """Touched every couple of seconds by a thread of rank ``rank`` while the process runs
        (a rank waiting in a collective included): the worker reads a stale one as a stopped or
        hung rank."""
        return self.root / "alive" / f"rank-{rank}"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def adapter_dir(self) -> Path:
        return self.root / "adapter"

    def checkpoint_tag(self, step: int) -> str:
        return f"step-{step:08d}"

    def published_marker(self, tag: str) -> Path:
        """Written by the worker once checkpoint ``tag`` is committed in the artifact store:
        the ranks wait for it before they save the next one."""
        return self.root / "published" / tag

    def pause_request(self, attempt: int) -> Path:
        """Created by the worker when the job is to pause: the ranks of ``attempt`` see it after
        their next optimizer step, save a checkpoint there and exit (node 0's, for a gang; the
        ranks agree on it as on a stop, so every node leaves after the same step)."""
        return self.root / "pause" / f"requested-{attempt}"

    def paused_marker(self, attempt: int) -> Path:
        """Written by rank 0 once the ranks of ``attempt`` saved their pause checkpoint, as they
        leave: ``{"step": N}``. Without it, ranks that exited 0 finished the job."""
        return self.root / "pause" / f"paused-{attempt}.json"

    def paused_at(self, attempt: int) -> int | None:
        """The step the ranks of ``attempt`` paused at (their checkpoint's), or None."""
        try:
            return int(json.loads(self.paused_marker(attempt).read_text(encoding="utf-8"))["step"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def local_checkpoints(self) -> dict[int, Path]:
        """The DeepSpeed checkpoint directories on this disk, by step, complete or not."""
        found = {}
        for directory in self.checkpoints_dir.glob("step-*"):
            step = directory.name.removeprefix("step-")
            if step.isdigit() and directory.is_dir():
                found[int(step)] = directory
        return dict(sorted(found.items()))

    def remove_local_checkpoint(self, step: int) -> None:
        """Delete this disk's copy of the checkpoint of ``step`` and its published marker."""
        tag = self.checkpoint_tag(step)
        shutil.rmtree(self.checkpoints_dir / tag, ignore_errors=True)
        self.published_marker(tag).unlink(missing_ok=True)

    def incomplete_saves(self) -> list[Path]:
        """What saves that never finished left (a full disk, a killed rank): checkpoint
        directories without a manifest and half-written exports (``*.partial``)."""
        manifest = CheckpointManifest.FILENAME
        incomplete = [d for d in self.local_checkpoints().values() if not (d / manifest).exists()]
        return incomplete + [d for d in self.root.glob("*.partial") if d.is_dir()]

    def remove_incomplete_saves(self) -> list[Path]:
        """Delete ``incomplete_saves``: nothing reads them, and on a full disk they hold the
        space the next job needs. Only for the worker that owns the job, once its ranks are gone."""
        incomplete = self.incomplete_saves()
        for directory in incomplete:
            shutil.rmtree(directory, ignore_errors=True)
        return incomplete


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON so that readers see the old file or the whole new one, never half of it
    (and a write that fails, on a full disk, leaves no temporary file behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_from(path: Path, offset: int, *, max_bytes: int = 1 << 20) -> str:
    """The text of ``path`` after byte ``offset`` (its last ``max_bytes`` when there is more)."""
    if not path.exists():
        return ""
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(offset, end - max_bytes))
        return f.read().decode("utf-8", errors="replace")


def tail_lines(path: Path, n: int, *, block: int = 64 * 1024) -> list[str]:
    """The last ``n`` lines of a text file, reading backwards so big logs cost little."""
    if n <= 0 or not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        data = b""
        while end > 0 and data.count(b"\n") <= n:
            start = max(0, end - block)
            f.seek(start)
            data = f.read(end - start) + data
            end = start
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-n:]


class CheckpointManifest(BaseModel):
    """Written atomically into a checkpoint directory after every rank's save returned.

    A checkpoint directory without a manifest is incomplete (a save that was interrupted)
    and is never listed or resumed from.
    """

    step: int
    tag: str
    kind: str
    world_size: int
    zero_stage: int | None = None
    files: dict[str, int]
    bytes: int
    created_at: str

    FILENAME: ClassVar[str] = "tuneq-manifest.json"

    @classmethod
    def describe(cls, directory: Path, **fields: Any) -> CheckpointManifest:
        files = {
            str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != cls.FILENAME
        }
        return cls(files=files, bytes=sum(files.values()), **fields)

    def write(self, directory: Path) -> None:
        write_json_atomic(directory / self.FILENAME, self.model_dump())

    @classmethod
    def read(cls, directory: Path) -> CheckpointManifest | None:
        path = directory / cls.FILENAME
        if not path.is_file():
            return None
        return cls.model_validate_json(path.read_text(encoding="utf-8"))
