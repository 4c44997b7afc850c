"""Compile the DeepSpeed ops a worker's ranks load, ahead of the first job.

DeepSpeed compiles an op the first time a rank uses it: CPU Adam for ``offload_optimizer``,
fused Adam for optimizers on a GPU, and on a CPU host the shared-memory all-reduce its torch
comm backend loads in ``init_distributed``; a minute or more, inside the first job's startup
(and, for a compiler's gigabytes, in its peak memory).
``tuneq build-ops`` (run by ``make install``) runs this module with the ranks' own environment
(worker.launcher.rank_environment), so the build lands where the ranks look for it: one
directory per virtual environment (``OPS_BUILD_DIR``) unless TORCH_EXTENSIONS_DIR says
otherwise. It says which op it builds, how long each took and whether ccache had it, and which
ops this host's accelerator has no use for. An image built with ``DS_BUILD_*`` (Dockerfile.gpu)
has these ops compiled into DeepSpeed itself, and this finds them there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.jobs.run_layout import write_json_atomic

logger = logging.getLogger(__name__)

# ShareMemCommBuilder exists only on the CPU accelerator; on others _op_builders skips it.
# Each is loaded by some job on the CPU path too: CPU Adam by an offloaded optimizer (the seed
# config, the demo's), fused Adam by Adam and AdamW not offloaded (every chosen config on a CPU
# worker), the shared-memory all-reduce by every CPU job's init_distributed, one rank or more.
OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")
# What each op is for, as `tuneq build-ops` says it.
OP_USES = {
    "CPUAdamBuilder": "CPU Adam, for offload_optimizer",
    "FusedAdamBuilder": "fused Adam, for Adam and AdamW not offloaded",
    "ShareMemCommBuilder": "shared-memory all-reduce, for the ranks of a CPU host",
}
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
    """Load (and compile, where not yet built) every op of OPS this host's accelerator has and
    can build, saying as it goes which op, how long it took and how (OpBuild), and which ops it
    skips and why."""
    from deepspeed.accelerator import get_accelerator

    remember_cpu_info()
    accelerator = get_accelerator().device_name()
    directory = extensions_dir()
    compiler_cache = CompilerCache.find()
    logger.info(
        "DeepSpeed's ops for the %s accelerator, into %s (%s)", accelerator, directory, compiler_cache.description
    )
    started = time.monotonic()
    built = []
    have = dict(_op_builders())
    with abandoned_build_locks_removed(directory):
        for name in OPS:
            builder = have.get(name)
            if builder is None:
                logger.info("%s (%s): skipped, the %s accelerator has no such op", name, OP_USES[name], accelerator)
            elif not builder.is_compatible(verbose=True):  # DeepSpeed prints why
                logger.info("%s (%s): skipped, DeepSpeed cannot build it on this host", builder.name, OP_USES[name])
            else:
                logger.info("%s (%s): started%s", builder.name, OP_USES[name], _first_build_note(builder, directory))
                build = OpBuild.of(builder, directory=directory, compiler_cache=compiler_cache)
                logger.info("%s: done in %s (%s)", builder.name, duration_text(build.seconds), build.how)
                built.append(name)
    names = ", ".join(have[name].name for name in built) or "none"
    logger.info("DeepSpeed's ops ready in %s: %s", duration_text(time.monotonic() - started), names)
    return built


def _first_build_note(builder: Any, directory: Path) -> str:
    """What to expect of a load that compiles: where the op has no build yet, say so."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(builder.name) or (directory / builder.name / f"{builder.name}.so").exists():
        return ""
    return ", not built yet: a minute or two of compiling on 2 cores, seconds with ccache"


def duration_text(seconds: float) -> str:
    """``0.4 s``, ``64 s``, ``3 min 19 s``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


@dataclass(frozen=True)
class CompilerCache:
    """The compiler cache torch's JIT compiles through: ccache where it is on PATH (torch looks
    there: ``cpp_extension._wrap_compiler``), unless TORCH_NO_COMPILER_WRAPPER is set."""

    command: str | None

    @classmethod
    def find(cls) -> CompilerCache:
        if os.environ.get("TORCH_NO_COMPILER_WRAPPER"):
            return cls(None)
        return cls(shutil.which("ccache"))

    @property
    def description(self) -> str:
        if self.command is None:
            return "no ccache: every source is compiled; with ccache a build in another checkout takes seconds"
        return f"through {self.command}"

    def counts(self) -> dict[str, int]:
        """ccache's counters (hits and misses), or nothing where it cannot say (no ccache, one
        too old for ``--print-stats``)."""
        if self.command is None:
            return {}
        try:
            done = subprocess.run(
                [self.command, "--print-stats"], capture_output=True, text=True, timeout=30, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return {}
        counts = {}
        for line in done.stdout.splitlines():
            name, _, value = line.partition("\t")
            if value.strip().isdigit():
                counts[name] = int(value)
        return counts


@dataclass(frozen=True)
class OpBuild:
    """One op loaded by ``build_ops``: how long it took and how it was had."""

    seconds: float
    how: str  # "compiled", "from ccache", "already built", "built into DeepSpeed", ...

    @classmethod
    def of(cls, builder: Any, *, directory: Path, compiler_cache: CompilerCache) -> OpBuild:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get(builder.name):
            started = time.monotonic()
            builder.load()
            return cls(time.monotonic() - started, "built into DeepSpeed")
        outputs = directory / builder.name
        before, counts = _build_outputs(outputs), compiler_cache.counts()
        started = time.monotonic()
        builder.load()
        seconds = time.monotonic() - started
        changed = {path for path, stamp in _build_outputs(outputs).items() if before.get(path) != stamp}
        compiled = sum(1 for path in changed if path.endswith(".o"))
        if not changed:
            return cls(seconds, "already built")
        return cls(seconds, _compiled_how(compiled, counts, compiler_cache.counts()))


def _build_outputs(directory: Path) -> dict[str, int]:
    """The objects and libraries of one op's JIT build, by when they were last written."""
    stamps = {}
    for path in (*directory.glob("*.o"), *directory.glob("*.so")):
        with contextlib.suppress(FileNotFoundError):
            stamps[path.name] = path.stat().st_mtime_ns
    return stamps


def _compiled_how(sources: int, before: dict[str, int], after: dict[str, int]) -> str:
    """How an op's ``sources`` compiled objects were had: from ccache's counters around it,
    where there are any (other compiles on the host at the same time count too)."""
    if not sources:
        return "linked again"
    hits = sum(after.get(k, 0) - before.get(k, 0) for k in ("direct_cache_hit", "preprocessed_cache_hit"))
    if not after or hits <= 0:
        return f"compiled, {sources} source{'s' if sources > 1 else ''}"
    if hits >= sources:
        return "from ccache"
    return f"{hits} of {sources} sources from ccache, the others compiled"


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
    build_ops()
