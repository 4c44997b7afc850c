"""Fixtures of the worker's tests: DeepSpeed's ops as a killed loader leaves them."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from shared.jobs.hardware import Hardware
from worker import launcher
from worker.deepspeed_ops import OPS


def abandon_lock(path: Path) -> Path:
    """The build lock a process killed while torch's JIT held it leaves behind: the file, and
    no process with it open."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL))
    return path


class LockedOps(NamedTuple):
    directory: Path  # a TORCH_EXTENSIONS_DIR
    locks: list[Path]


@pytest.fixture
def ops_left_locked() -> Iterator[LockedOps]:
    """A copy of the ops `make install` built (`tuneq build-ops`), each op's build lock left
    behind by a loader killed mid-load. The copy sits beside the built ops: ninja keeps its
    dependencies' paths relative to the build directory (and ccache hashes them so), so only
    there does it find the copy built instead of compiling it again."""
    env = launcher.rank_environment(Hardware("cpu", 1), num_ranks=1, worker_pid=os.getpid())
    built = Path(env["TORCH_EXTENSIONS_DIR"])
    copy = built.with_name(f"{built.name}-test-{uuid.uuid4().hex[:8]}")
    shutil.copytree(built, copy, symlinks=True)
    try:
        locks = [abandon_lock(op / "lock") for op in sorted(copy.iterdir()) if (op / "build.ninja").exists()]
        assert len(locks) == len(OPS), f"the ops are not built in {built}: `make install` builds them"
        yield LockedOps(copy, locks)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
