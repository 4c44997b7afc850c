"""Compile the DeepSpeed ops a worker's ranks load, ahead of the first job.

DeepSpeed compiles an op the first time a rank uses it: CPU Adam for ``offload_optimizer``,
fused Adam for optimizers on a GPU, and on a CPU host the shared-memory all-reduce its torch
comm backend loads in ``init_distributed``; a minute or more, inside the first job's startup
(and, for a compiler's gigabytes, in its peak memory).
``tuneq build-ops`` (run by ``make install``) runs this module with the ranks' own environment
(worker.launcher.rank_environment), so the build lands where the ranks look for it: one
directory per virtual environment (``OPS_BUILD_DIR``) unless TORCH_EXTENSIONS_DIR says
otherwise. An image built with ``DS_BUILD_*`` (Dockerfile.gpu) has these ops compiled into
DeepSpeed itself, and this finds them there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shared.jobs.run_layout import write_json_atomic

logger = logging.getLogger(__name__)

# ShareMemCommBuilder exists only on the CPU accelerator; on others _op_builders skips it.
OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")
# Where the JIT-compiled ops go: one directory per virtual environment, as a clone with other
# include paths would rebuild a shared one in turn.
OPS_BUILD_DIR = Path(sys.prefix) / "torch_extensions"


def remember_cpu_info() -> None:
    """Ask py-cpuinfo once per host, not on every call. Its ``get_cpu_info`` starts a Python
    subprocess each time (over a second of CPU), and DeepSpeed calls it twice for each op it
    loads (the ``-march`` and SIMD flags) and again for each CPU Adam optimizer it makes. The
    answer is kept for the process (ranks forked from the warm start inherit it) and beside the
    ops it chose the flags of (``TORCH_EXTENSIONS_DIR/tuneq-cpuinfo``, the ranks' environment's,
    else ``OPS_BUILD_DIR``), keyed by ``/proc/cpuinfo`` without its clock lines: the
    next worker's warm start, a rank DeepSpeed's launcher starts, or ``tuneq build-ops`` reads
    it instead of asking again. Another CPU (the environment copied, a VM migrated) is another key."""
    import cpuinfo

    if hasattr(cpuinfo.get_cpu_info, "cache_info"):
        return
    ask = cpuinfo.get_cpu_info
    path = _cpu_info_path(cpuinfo.CPUINFO_VERSION_STRING)

    def asked_once() -> Any:
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                return json.loads(path.read_text(encoding="utf-8"))
        info = ask()
        if path is not None:
            try:
                write_json_atomic(path, info)
            except OSError as e:  # a full or read-only disk: asked again next time
                logger.debug("could not keep the CPU's description at %s: %s", path, e)
        return info

    cpuinfo.get_cpu_info = functools.cache(asked_once)


def _cpu_info_path(version: str) -> Path | None:
    """Where this host's py-cpuinfo answer is kept; None without /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    described = "\n".join(line for line in lines if not line.startswith("cpu MHz"))  # the clock moves
    key = hashlib.sha256(f"{version}\n{described}".encode()).hexdigest()[:16]
    return extensions_dir() / "tuneq-cpuinfo" / f"{key}.json"


def extensions_dir() -> Path:
    """Where this process's JIT builds of the ops go: TORCH_EXTENSIONS_DIR where it is set,
    else OPS_BUILD_DIR (what the ranks' environment sets it to)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR", OPS_BUILD_DIR))


# How often a lock of torch's JIT build is looked at while ops load; it is abandoned once seen
# unheld on two looks this far apart (see AbandonedBuildLocks).
BUILD_LOCK_CHECK_SECONDS = 1.0


class AbandonedBuildLocks:
    """Finds and removes the build locks that processes killed mid-load left behind.

    torch's JIT (``torch.utils.cpp_extension``) takes ``<build dir>/lock`` for every load of
    an op, a built one too (it runs ninja to check the build): it creates the file, keeps it
    open, and removes it when done. A process killed in between (a zygote that a SIGTERM to its
    worker's process group ends while it preloads, as systemd's stop sends one; SIGKILL; the
    OOM killer) leaves the file, and every later load of that op on the host, in any job,
    waits for it forever (``FileBaton.wait``).

    A lock is abandoned when no process has it open, seen on two looks (``scan``) at least
    BUILD_LOCK_CHECK_SECONDS apart: the one moment a live holder has it closed is between its
    ``close`` and ``remove`` at release, far shorter than that. Without ``/proc`` nothing is
    removed, and processes of other users (whose open files cannot be read) are assumed not
    to hold the ops of this environment."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.unheld: dict[tuple[int, int], Path] = {}  # seen unheld on the last look
        self.removed: list[Path] = []

    def scan(self) -> bool:
        """One look: remove the locks seen unheld on this look and the last one. True when a
        lock was left unheld on this look (another look decides). Never raises: a look that
        fails leaves the load as torch would have it."""
        try:
            return self._look()
        except OSError as e:
            logger.debug("could not look for abandoned build locks in %s: %s", self.directory, e)
            return False

    def _look(self) -> bool:
        locks = {}
        for lock in self.directory.glob("*/lock"):
            with contextlib.suppress(FileNotFoundError):
                info = lock.stat()
                locks[(info.st_dev, info.st_ino)] = lock
        if not locks or not Path("/proc/self/fd").is_dir():
            self.unheld = {}
            return False
        for held in _open_locks():
            locks.pop(held, None)
        for key, lock in list(locks.items()):
            if key in self.unheld and self._remove(lock, key):
                del locks[key]
        self.unheld = locks
        return bool(self.unheld)

    def _remove(self, lock: Path, key: tuple[int, int]) -> bool:
        try:
            info = lock.stat()
            if (info.st_dev, info.st_ino) != key:
                return False  # released, and taken again since the last look
            lock.unlink()
        except FileNotFoundError:
            return True  # released since
        except OSError as e:  # a read-only build directory: the load waits as torch would
            logger.warning("could not remove the abandoned build lock %s: %s", lock, e)
            return False
        self.removed.append(lock)
        logger.warning(
            "removed %s: a process loading DeepSpeed's %s op was killed before it released "
            "this lock, which would hold every later load of the op",
            lock,
            lock.parent.name,
        )
        return True


def _open_locks() -> Iterator[tuple[int, int]]:
    """(device, inode) of each file named ``lock`` that a process this one can see has open."""
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            names = os.listdir(fds)
        except OSError:  # gone, or another user's
            continue
        for name in names:
            path = fds / name
            try:
                if os.readlink(path).endswith("/lock"):
                    info = path.stat()
                    yield info.st_dev, info.st_ino
            except OSError:
                continue


@contextlib.contextmanager
def abandoned_build_locks_removed(directory: Path | None = None) -> Iterator[AbandonedBuildLocks]:
    """Around code that loads ops: first remove the abandoned build locks (a look, and a second
    one a moment later where one is unheld, so that this process takes the lock itself and
    ninja mends what the killed one left half built), then keep looking while the body runs,
    for a holder killed while this process waits on it. The looking thread ends with the body
    (the zygote forks only single-threaded)."""
    locks = AbandonedBuildLocks(directory or extensions_dir())
    if locks.scan():
        time.sleep(BUILD_LOCK_CHECK_SECONDS)
        locks.scan()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(BUILD_LOCK_CHECK_SECONDS):
            locks.scan()

    watcher = threading.Thread(target=watch, name="tuneq-build-locks", daemon=True)
    watcher.start()
    try:
        yield locks
    finally:
        done.set()
        watcher.join()


def _op_builders() -> Iterator[tuple[str, Any]]:
    """Each op of OPS this host's accelerator has: its name and op builder."""
    from deepspeed.accelerator import get_accelerator

    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None:
            yield name, builder


def build_ops() -> list[str]:
    """Load (and compile, where not yet built) every op of OPS this host's accelerator has."""
    remember_cpu_info()
    built = []
    with abandoned_build_locks_removed():
        for name, builder in _op_builders():
            if builder.is_compatible():
                builder.load()
                built.append(name)
    return built


def preload_ops() -> list[str]:
    """Load the ops of OPS into this process where that cannot initialise CUDA: for the warm
    start (worker.rank.zygote), whose forked ranks then find them loaded (DeepSpeed keeps the
    ops it loaded per process) instead of each spending seconds in ``torch.utils.cpp_extension``
    checking a JIT build. An op built into DeepSpeed (DS_BUILD_*) is an import; a JIT build is
    loaded (compiled, if ``tuneq build-ops`` did not) only on the CPU accelerator: on a GPU it
    reads the device's compute capability, which initialises CUDA, and forked ranks could not
    use it. An op that fails to load is left to the ranks, which report it as they would."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    remember_cpu_info()
    on_cpu = get_accelerator().device_name() == "cpu"
    loaded = []
    with abandoned_build_locks_removed():
        for name, builder in _op_builders():
            if not (installed_ops.get(builder.name) or on_cpu):
                continue
            try:
                if builder.is_compatible():
                    builder.load()
                    loaded.append(name)
            except Exception:
                logger.warning("could not preload DeepSpeed's %s; the ranks load it themselves", name, exc_info=True)
    return loaded


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("DeepSpeed ops ready: %s", ", ".join(build_ops()) or "none")
