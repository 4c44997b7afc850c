"""Whether this worker's disk has room for a job: checkpoints and exports are written under
TUNEQ_HOME, and a worker that takes jobs on a full disk fails every one of them."""

from __future__ import annotations

import shutil

from shared.settings import Settings

MB = 1024**2


def disk_problem(settings: Settings) -> str | None:
    """Why the disk holding TUNEQ_HOME is too full to take a job (TUNEQ_MIN_FREE_DISK_MB), or None."""
    if settings.min_free_disk_mb <= 0:
        return None
    free = shutil.disk_usage(settings.home).free
    if free >= settings.min_free_disk_mb * MB:
        return None
    return (
        f"the disk holding TUNEQ_HOME ({settings.home}) has {free // MB} MB free, under "
        f"TUNEQ_MIN_FREE_DISK_MB ({settings.min_free_disk_mb}): this worker takes no job until space is freed"
    )
