"""Fixtures of the worker's tests: DeepSpeed's ops as a killed loader leaves them, a warm
launcher, and a job run as Celery's pool process runs it."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from shared.db.models import Job
from shared.jobs.hardware import Hardware
from shared.settings import get_settings
from worker import launcher
from worker.deepspeed_ops import OPS
from worker.launcher import Launcher
from worker.runner import run_job


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


@pytest.fixture
def warm_launcher() -> Iterator[Launcher]:
    hardware = Hardware("cpu", 1)
    """A launcher with a warm start, as a worker's pool process has (worker/tasks.py)."""
    launcher.build_ops(hardware)  # built by `make install`: seconds, never a compile in a step
    ranks_launcher = Launcher(hardware=hardware, settings=get_settings())
    yield ranks_launcher
    ranks_launcher.close()


def queued_training_job(model: Path, dataset: Path, training: dict[str, object], **fields: object) -> Job:
    """A queued job that trains ``model`` on ``dataset`` (a row as a submit makes it, for the
    runner to claim)."""
    from sqlmodel import Session

    from cli.samples import seed_config
    from shared.db.engine import get_engine

    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(
            model=str(model),
            dataset=str(dataset),
            deepspeed_config=seed_config(fp16=False),
            num_gpus=1,
            training=training,
            **fields,
        )
        session.add(job)
        session.commit()
    return job


def run_as_a_pool_process(job: Job, launcher: Launcher) -> bool:
    """``run_job`` as Celery's pool process runs it (worker/tasks.py notes a SIGTERM that comes
    before the runner handles it); True when the attempt was handed back and the process exits."""
    stopping = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda _signum, _frame: stopping.set())
    try:
        run_job(job.id, settings=get_settings(), launcher=launcher, worker_id="w", stopping=stopping)
    except SystemExit as exited:
        assert exited.code == 0
        return True
    finally:
        signal.signal(signal.SIGTERM, previous)
    return False
