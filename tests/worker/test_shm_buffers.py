"""DeepSpeed's all-reduce buffers in /dev/shm: a job's are removed with its ranks, and a worker
removes those whose ranks are gone, when it starts and on every reconciler pass."""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from shared.ports import free_port
from shared.settings import Settings
from worker import reconciler, shm_buffers
from worker.shm_buffers import BUFFER_PREFIX, job_buffers, remove_job_buffers, remove_stale_buffers

UID = os.getuid()


def buffer(shm: Path, *, port: int, rank: int, uid: int = UID) -> Path:
    path = shm / f"{BUFFER_PREFIX}_{uid}_127.0.0.1_{port}_{rank}"
    path.write_bytes(b"\0" * 4096)
    return path


def test_a_jobs_buffers_are_named_by_its_master_port(tmp_path: Path) -> None:
    mine = [buffer(tmp_path, port=29500, rank=0), buffer(tmp_path, port=29500, rank=1)]
    other_job = buffer(tmp_path, port=29501, rank=0)
    port_prefix = buffer(tmp_path, port=295000, rank=0)  # 29500 is a prefix of it, not its port
    other_user = buffer(tmp_path, port=29500, rank=0, uid=UID + 1)
    unrelated = tmp_path / "PostgreSQL.12345"
    unrelated.write_bytes(b"x")

    assert job_buffers(29500, shm_dir=tmp_path) == mine
    assert remove_job_buffers(29500, shm_dir=tmp_path) == 2
    assert not any(p.exists() for p in mine)
    assert all(p.exists() for p in (other_job, port_prefix, other_user, unrelated))
    assert remove_job_buffers(29500, shm_dir=tmp_path) == 0  # removing twice is harmless


def test_the_start_up_sweep_removes_only_buffers_whose_ranks_are_gone(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as rendezvous:  # rank 0's store of a starting job
        starting_port = rendezvous.getsockname()[1]
        dead = buffer(tmp_path, port=free_port(), rank=0)
        starting = buffer(tmp_path, port=starting_port, rank=1)  # created, not mapped yet
        mapped = buffer(tmp_path, port=free_port(), rank=0)
        other_user = buffer(tmp_path, port=free_port(), rank=0, uid=UID + 1)
        assert starting_port in shm_buffers.listening_ports()
        with mapped.open("r+b") as f, mmap.mmap(f.fileno(), 0) as live:  # a running rank's mapping
            assert str(mapped) in shm_buffers.mapped_paths()
            assert remove_stale_buffers(shm_dir=tmp_path) == 1
            assert live[:1] == b"\0"
        assert not dead.exists()
        assert starting.exists() and mapped.exists() and other_user.exists()
    assert remove_stale_buffers(shm_dir=tmp_path) == 2  # that job's store is gone, and nothing maps the other
    assert other_user.exists()


def test_the_reconciler_sweeps_buffers_whose_ranks_died_after_the_worker_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker started while a killed worker's ranks were still dying found their buffers
    mapped at start-up; its reconciler removes them once they are not, even while the
    database is unreachable."""

    def database_down(**_: object) -> None:
        raise ConnectionError("database unreachable")

    monkeypatch.setattr(reconciler, "reconcile_once", database_down)
    left = buffer(shm_buffers.SHM_DIR, port=free_port(), rank=0)
    stop = threading.Event()
    sweeping = threading.Thread(
        target=reconciler.run_reconciler, kwargs={"settings": Settings(reconcile_seconds=0.05), "stop": stop}
    )
    sweeping.start()
    try:
        deadline = time.monotonic() + 10
        while left.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left.exists()
    finally:
        stop.set()
        sweeping.join()
        left.unlink(missing_ok=True)
