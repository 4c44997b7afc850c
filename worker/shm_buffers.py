"""DeepSpeed's shared-memory all-reduce buffers: removed when a job's ranks are gone.

On the CPU accelerator, DeepSpeed's ``deepspeed_shm_comm`` op (built by ``tuneq build-ops``,
preloaded by the warm start) gives every rank a 66 MB segment,
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``, and never
unlinks it: each job would leave its ranks' segments in RAM for good. A job's master port is
free when its ranks start and is held by them until they exit, so the port names one job's
segments among all those of the host; once its ranks have exited the worker removes them
(:func:`remove_job_buffers`). A worker killed before it could do so leaves them behind, so a
worker also removes the segments of jobs whose ranks are gone (:func:`remove_stale_buffers`)
when it starts and on every pass of its reconciler (ranks still dying at its start are swept
on a later pass).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
BUFFER_PREFIX = "deepspeed_allreduce_buffer"  # SHM_BUFFER_NAME in DeepSpeed's csrc/cpu/comm/shm.cpp
_TCP_LISTEN = "0A"  # the LISTEN state in /proc/net/tcp


def job_buffers(master_port: int, *, shm_dir: Path = SHM_DIR) -> list[Path]:
    """This user's all-reduce segments of the job whose ranks rendezvoused on ``master_port``."""
    return sorted(shm_dir.glob(f"{BUFFER_PREFIX}_{os.getuid()}_*_{master_port}_*"))


def _remove(paths: list[Path]) -> int:
    removed = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def remove_job_buffers(master_port: int, *, shm_dir: Path = SHM_DIR) -> int:
    """Unlink a finished job's segments; how many there were. Safe while a dying rank still
    maps one: the memory goes back once its last mapping does."""
    removed = _remove(job_buffers(master_port, shm_dir=shm_dir))
    if removed:
        logger.debug("removed %d all-reduce buffer(s) of master port %d from %s", removed, master_port, shm_dir)
    return removed


def mapped_paths() -> set[str]:
    """Every file some process on this host maps (that this user may read the maps of)."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text(errors="replace").splitlines():
                _, _, path = line.partition("/")
                if path:
                    mapped.add("/" + path.removesuffix(" (deleted)"))
    return mapped


def listening_ports() -> set[int]:
    """The TCP ports something on this host listens on (every process's, from /proc/net)."""
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 3 and fields[3] == _TCP_LISTEN:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _master_port(path: Path) -> int | None:
    # <prefix>_<uid>_<addr>_<port>_<rank>: the address may hold underscores, the rest do not.
    parts = path.name.rsplit("_", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def remove_stale_buffers(*, shm_dir: Path = SHM_DIR) -> int:
    """Unlink this user's all-reduce segments whose job's ranks are gone: those of jobs whose
    worker died before it could remove them. A job's ranks are gone when no process maps its
    segments and nothing listens on its master port any more (rank 0's rendezvous store
    listens there from before the segments exist until the job ends, so a segment created a
    moment ago and not yet mapped is never taken for a stale one)."""
    candidates = list(shm_dir.glob(f"{BUFFER_PREFIX}_{os.getuid()}_*"))
    if not candidates:
        return 0
    mapped, listening = mapped_paths(), listening_ports()
    stale = [p for p in candidates if str(p) not in mapped and _master_port(p) not in listening]
    removed = _remove(stale)
    if removed:
        logger.info("removed %d all-reduce buffer(s) left in %s by jobs whose ranks are gone", removed, shm_dir)
    return removed
