"""Whether this worker's disk has room for a job: checkpoints and exports are written under
TUNEQ_HOME, and a worker that takes jobs on a full disk fails every one of them."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from shared.settings import Settings

MB = 1024**2
# The OS's own word for a write that found no room, as Python, the C library and torch print it.
NO_SPACE = re.compile(r"No space left on device|\[Errno 28\]|\bENOSPC\b")
# What a write that ran out of room looks like when the writer does not pass the OS's error
# on: torch.save's zip writer, and the C++ streams DeepSpeed's savers use.
WRITE_FAILED = re.compile(r"file write failed|iostream error|unexpected pos \d+ vs \d+", re.IGNORECASE)
# Where TUNEQ_MIN_FREE_DISK_MB is 0 (never checked), the free space under which a failed write
# is put down to the disk all the same.
NEARLY_FULL_MB = 64


def disk_problem(settings: Settings) -> str | None:
    """Why the disk holding TUNEQ_HOME is too full to take a job, or None: under
    TUNEQ_MIN_FREE_DISK_MB, or under what a job that ran out of disk here showed it needs
    (``note_full_disk``)."""
    free = shutil.disk_usage(settings.home).free
    if (raised := _raised_floor(settings, free)) is not None:
        return raised
    if settings.min_free_disk_mb <= 0 or free >= settings.min_free_disk_mb * MB:
        return None
    return (
        f"the disk holding TUNEQ_HOME ({settings.home}) has {free // MB} MB free, under "
        f"TUNEQ_MIN_FREE_DISK_MB ({settings.min_free_disk_mb}): this worker takes no job until space is freed"
    )


def _floor_file(settings: Settings) -> Path:
    return settings.home / "disk-full.json"


def note_full_disk(settings: Settings, *, job_id: str) -> None:
    """A job's ranks ran out of disk here, and what they were writing is removed: the room
    free now was too little for it, so this worker takes no job until more is free (the
    next job would fill it the same way): twice as much, at least TUNEQ_MIN_FREE_DISK_MB more.
    Kept on the disk itself, where the worker's main
    process and its pool process both read it."""
    free = shutil.disk_usage(settings.home).free
    needed = max(2 * free, free + settings.min_free_disk_mb * MB)  # twice the room that proved too little
    with contextlib.suppress(OSError):  # no room for even this: the floor of the setting holds
        _floor_file(settings).write_text(json.dumps({"job_id": job_id, "needed_bytes": needed}), encoding="utf-8")


def _raised_floor(settings: Settings, free: int) -> str | None:
    """Why the floor a full disk raised (``note_full_disk``) keeps this worker from a job; the
    floor is dropped once that much is free."""
    try:
        floor = json.loads(_floor_file(settings).read_text(encoding="utf-8"))
        needed, job_id = int(floor["needed_bytes"]), str(floor["job_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if free >= needed:
        _floor_file(settings).unlink(missing_ok=True)
        return None
    return (
        f"the disk holding TUNEQ_HOME ({settings.home}) filled up under job {job_id}: this worker takes no job "
        f"until {needed // MB} MB are free ({free // MB} MB now)"
    )


def full_disk_failure(settings: Settings, *, evidence: Iterable[str], unfinished_save: bool) -> str | None:
    """Why an attempt whose ranks failed failed for want of disk, or None: judged from the disk
    itself, since the rank that hit it may have died without a word (its error file and its log
    lines are writes too) while its peers report only the broken connection. The disk is the
    cause when the OS said so anywhere in ``evidence`` (the ranks' errors, the attempt's log), or
    when it is (nearly) full now, before the cleanup, and the ranks were writing: a save left
    unfinished (``unfinished_save``), or a write that failed."""
    texts = list(evidence)
    if any(NO_SPACE.search(text) for text in texts):
        return disk_problem(settings) or "No space left on device"
    full = disk_problem(settings)
    if full is None and settings.min_free_disk_mb <= 0:
        free = shutil.disk_usage(settings.home).free
        if free < NEARLY_FULL_MB * MB:
            full = f"the disk holding TUNEQ_HOME ({settings.home}) has {free // MB} MB free"
    if full is not None and (unfinished_save or any(WRITE_FAILED.search(text) for text in texts)):
        return full
    return None
