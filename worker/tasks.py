"""The Celery side: the task (as thin as a view), and in the worker's main process its
hardware registration, heartbeat and reconciler threads.

Run with ``tuneq worker`` (``celery -A worker.tasks worker``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any

from celery.signals import worker_process_init, worker_ready, worker_shutting_down

from shared.db import init_db, session_scope
from shared.lifecycle import mark_unpublished, register_worker, set_worker_idle, touch_worker
from shared.queue import RUN_JOB_TASK, declare_embedded_queue, get_celery, size_queue
from shared.settings import get_settings
from worker.launcher import HostHardware, detect_hardware, start_warm_start
from worker.reconciler import run_reconciler
from worker.runner import run_job

logger = logging.getLogger(__name__)

celery_app = get_celery()
HEARTBEAT_SECONDS = 30.0

# Filled in the worker's main process before the pool forks, inherited by the children.
_hardware: HostHardware | None = None
_worker_id = f"{socket.gethostname()}:{os.getpid()}"
# Set when the worker starts shutting down; pool children forked after it inherit it.
_stopping = threading.Event()


def _heartbeat(stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_SECONDS):
        try:
            with session_scope() as session:
                touch_worker(session=session, worker_id=_worker_id)
        except Exception:
            logger.exception("worker heartbeat failed")


@worker_ready.connect
def _on_worker_ready(**_kwargs: Any) -> None:
    hardware = current_hardware()
    with session_scope() as session:
        register_worker(
            session=session,
            worker_id=_worker_id,
            hostname=socket.gethostname(),
            accelerator=hardware.accelerator,
            device_count=hardware.device_count,
            queue=size_queue(get_settings(), hardware.device_count),
        )
    logger.info("worker %s ready: %d %s device(s)", _worker_id, hardware.device_count, hardware.accelerator)
    threading.Thread(target=_heartbeat, args=(_stopping,), name="heartbeat", daemon=True).start()
    threading.Thread(
        target=run_reconciler, kwargs={"settings": get_settings(), "stop": _stopping}, name="reconciler", daemon=True
    ).start()


@worker_shutting_down.connect
def _on_shutting_down(**_kwargs: Any) -> None:
    # A job this worker released on its way down must go to another worker (or to this one
    # after a restart), not back into a pool child Celery forks while it waits to exit.
    _stopping.set()


@worker_process_init.connect
def _on_process_init(**_kwargs: Any) -> None:
    # Engines hold connection pools; a forked child must not share its parent's sockets.
    from shared.db import get_engine

    get_engine().dispose(close=False)
    # The warm start belongs to the pool process that runs the jobs; it imports while idle.
    settings = get_settings()
    if settings.launcher == "warm":
        start_warm_start(current_hardware(), settings)


def current_hardware() -> HostHardware:
    global _hardware
    if _hardware is None:
        _hardware = detect_hardware()
    return _hardware


def prepare_worker() -> str:
    """What ``tuneq worker`` does before Celery starts: tables, directories, hardware, and
    its size's queue (declared before it registers, so nobody publishes there before): its name."""
    init_db()
    queue = size_queue(get_settings(), current_hardware().device_count)
    declare_embedded_queue(queue)
    return queue


@celery_app.task(name=RUN_JOB_TASK)
def run_job_task(job_id: str) -> None:
    if _stopping.is_set():
        with session_scope() as session:
            mark_unpublished(session=session, job_id=uuid.UUID(job_id))  # a reconciler publishes it again
        return
    with session_scope() as session:
        set_worker_idle(session=session, worker_id=_worker_id, idle=False)
    try:
        run_job(uuid.UUID(job_id), settings=get_settings(), hardware=current_hardware(), worker_id=_worker_id)
    finally:
        with session_scope() as session:
            set_worker_idle(session=session, worker_id=_worker_id, idle=True)
