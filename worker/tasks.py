"""The Celery side: the task (as thin as a view), and in the worker's main process its
hardware registration, heartbeat and reconciler threads.

Run with ``tuneq worker`` (``celery -A worker.tasks worker``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import signal
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, ClassVar

import psutil
from celery import Task
from celery.exceptions import SecurityWarning
from celery.signals import worker_process_init, worker_ready, worker_shutting_down
from celery.worker import state as worker_state

from shared.db.engine import init_db, session_scope
from shared.db.gangs import place_and_start
from shared.db.lifecycle import (
    mark_unpublished,
    register_worker,
    set_worker_idle,
    set_worker_unavailable,
    stop_worker,
    touch_worker,
)
from shared.jobs.hardware import Hardware
from shared.queue import RUN_JOB_TASK, RUN_NODE_TASK, declare_embedded_queue, get_celery, node_queue, size_queue
from shared.settings import Settings, get_settings
from worker.disk_space import disk_problem
from worker.launcher import Launcher, detect_hardware
from worker.reconciler import run_reconciler
from worker.runner import run_job, run_node
from worker.shm_buffers import remove_stale_buffers

logger = logging.getLogger(__name__)

celery_app = get_celery()
HEARTBEAT_SECONDS = 30.0
# A stopping worker stops its ranks (10 s of grace) and releases its job; past this it is killed.
WORKER_STOP_DEADLINE_SECONDS = 60

# Filled in the worker's main process before the pool forks, inherited by the children.
_hardware: Hardware | None = None
_worker_id = f"{socket.gethostname()}:{os.getpid()}"
# Set when the worker starts shutting down; pool children forked after it inherit it, and a pool
# child sets its own when a SIGTERM reaches it (_note_stop).
_stopping = threading.Event()
# The worker's main process writes 1 here when it starts shutting down, before it signals its
# pool child: anonymous shared memory, mapped before the pool forks, so that a pool child reads
# what the main process wrote since (``_stopping`` is each process's own).
_main_process_stopping = mmap.mmap(-1, 1)
# How long a pool child that handed its job back waits to see the main process stopping: a
# SIGTERM to the whole process group reaches both at once.
MAIN_PROCESS_STOP_WAIT_SECONDS = 2.0


def _heartbeat(stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_SECONDS):
        try:
            with session_scope() as session:
                touch_worker(session=session, worker_id=_worker_id)
            check_disk()
        except Exception:
            logger.exception("worker heartbeat failed")


_unavailable: str | None = None  # what this process last said in the worker's row


def check_disk() -> str | None:
    """Whether this worker's disk is too full to take a job, said in its log and its row (where
    routing, republishing and /metrics read it) whenever that changes."""
    global _unavailable
    problem = disk_problem(get_settings())
    if problem != _unavailable:
        with session_scope() as session:
            set_worker_unavailable(session=session, worker_id=_worker_id, reason=problem)
        if problem is not None:
            logger.warning("worker %s takes no jobs: %s", _worker_id, problem)
        else:
            logger.info("worker %s takes jobs again: its disk has room", _worker_id)
        _unavailable = problem
    return problem


def advertised_address(settings: Settings) -> str:
    """Where the other nodes of a multi-node job reach this worker's ranks: TUNEQ_WORKER_ADDRESS,
    else the address of the interface holding the default route (nothing is sent), else
    loopback (a host with no route out can only be a one-host deployment)."""
    if settings.worker_address:
        return settings.worker_address
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed like any outside address, never reached
        return str(probe.getsockname()[0])
    return "127.0.0.1"


@worker_ready.connect
def _on_worker_ready(**_kwargs: Any) -> None:
    hardware = current_hardware()
    settings = get_settings()
    with session_scope() as session:
        register_worker(
            session=session,
            worker_id=_worker_id,
            hostname=socket.gethostname(),
            accelerator=hardware.accelerator,
            device_count=hardware.device_count,
            queue=size_queue(settings, hardware.device_count),
            address=advertised_address(settings),
            device_memory_bytes=hardware.device_memory_bytes,
            bf16_supported=hardware.bf16_supported,
        )
    logger.info(
        "worker %s ready: %d %s device(s), %.1f GiB %s, bf16 %s",
        _worker_id,
        hardware.device_count,
        hardware.accelerator,
        (hardware.device_memory_bytes or 0) / 2**30,
        "of host memory" if hardware.accelerator == "cpu" else "on the smallest",
        "native" if hardware.bf16_supported else "not native",
    )
    check_disk()
    threading.Thread(target=_heartbeat, args=(_stopping,), name="heartbeat", daemon=True).start()
    threading.Thread(
        target=run_reconciler, kwargs={"settings": get_settings(), "stop": _stopping}, name="reconciler", daemon=True
    ).start()


def _exit_by_deadline() -> None:
    """The last word on a worker's stop: Celery's warm shutdown waits for its pool child, and
    a child that died mid start-up (its warm start on a broken pipe) was seen to leave the main
    process waiting forever, deaf to SIGTERM. Past the deadline the worker kills its
    descendants (the pool child, the warm start, any ranks left) and then itself."""
    time.sleep(WORKER_STOP_DEADLINE_SECONDS)
    logger.error("worker %s did not stop within %ds; killing its processes", _worker_id, WORKER_STOP_DEADLINE_SECONDS)
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


@worker_shutting_down.connect
def _on_shutting_down(**_kwargs: Any) -> None:
    _main_process_stopping[0] = 1
    if not _stopping.is_set():
        threading.Thread(target=_exit_by_deadline, name="stop-deadline", daemon=True).start()
        # Celery's warm shutdown waits for the running task, which is hours of training: the
        # pool child running a job gets the SIGTERM too (an init such as docker's signals only
        # this process), stops its ranks and releases the job. Idle children Celery stops itself.
        for request in list(worker_state.active_requests):
            if request.worker_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(request.worker_pid, signal.SIGTERM)
    # A job this worker released on its way down must go to another worker (or to this one
    # after a restart), not back into a pool child Celery forks while it waits to exit.
    _stopping.set()
    # And the others must know now, not when the heartbeat ages out: a stopped worker that
    # still looked live and idle made every reconciler republish its queue's waiting jobs.
    try:
        with session_scope() as session:
            stop_worker(session=session, worker_id=_worker_id)
    except Exception:
        logger.exception("could not mark worker %s stopped; it ages out after TUNEQ_WORKER_SEEN_SECONDS", _worker_id)


def _note_stop(_signum: int, _frame: FrameType | None) -> None:
    _stopping.set()


def _note_stops() -> None:
    """In a pool process, from its first task on: a SIGTERM sets ``_stopping`` instead of being
    ignored (_on_process_init), so that one that comes while a job is claimed, before the runner
    handles SIGTERM itself, still stops it (the runner checks ``_stopping``)."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:  # not in Celery's main process
        signal.signal(signal.SIGTERM, _note_stop)


@worker_process_init.connect
def _on_process_init(**_kwargs: Any) -> None:
    # Engines hold connection pools; a forked child must not share its parent's sockets.
    from shared.db.engine import get_engine

    get_engine().dispose(close=False)
    # A SIGTERM to the whole process group (systemd's default KillMode, a `kill -- -PGID`) reaches
    # this process too. Celery's pool exited on it wherever the process was: in the middle of
    # writing to the pool's result queue (its start-up message, a task's result) it died holding
    # that queue's lock, and the main process's warm shutdown waited on the lock until the stop
    # deadline (60 s, then SIGKILL); otherwise the worker logged an ERROR for its child. The main
    # process stops idle children itself, so an idle one ignores SIGTERM (a Python handler set
    # here would not last: the pool replaces any but SIG_IGN once this returns); from its first
    # task on, it notes it instead (_note_stops).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The launcher, and with it the warm start, belongs to the pool process that runs the
    # jobs: made now, the warm start imports while the process is idle. Not in a child Celery
    # forks while the worker stops (it replaces a child that died, one that a SIGTERM reached
    # before this function ran, say): that child runs no job, and its warm start imported torch
    # for seconds of CPU during the stop and outlived the worker.
    if not _stopping.is_set():
        JobTask.process_launcher()


def current_hardware() -> Hardware:
    global _hardware
    if _hardware is None:
        _hardware = detect_hardware()
    return _hardware


def prepare_worker() -> list[str]:
    """What ``tuneq worker`` does before Celery starts: tables, directories, hardware, and the
    queues it consumes (declared before it registers, so nobody publishes there before): its
    size's, and its own (the nodes of multi-node jobs placed on it)."""
    init_db()
    remove_stale_buffers()  # those of jobs whose worker was killed before it could remove them
    ignore_root_warning_for_json()
    queues = [size_queue(get_settings(), current_hardware().device_count), node_queue(get_settings(), _worker_id)]
    for queue in queues:
        declare_embedded_queue(queue)
    return queues


def ignore_root_warning_for_json() -> None:
    """Celery warns at every start as root (``SecurityWarning: You're running the worker with
    superuser privileges: this is absolutely not recommended!``, eight lines), whatever the
    worker accepts. The danger it names is a message that unpickles into code run as root; and
    for that case Celery refuses to start unless C_FORCE_ROOT is set, which is the setting it
    documents for root. tuneq's workers accept JSON alone (shared.queue.make_celery), for which
    C_FORCE_ROOT changes nothing and the warning only says what a root shell (a container, a
    VM, ``tuneq dev``) already knows, so it is not shown. Were pickle ever accepted, it would be
    again (and Celery would refuse root)."""
    accepted = {str(content) for content in celery_app.conf.accept_content or ()}
    if not accepted & {"pickle", "application/x-python-serialize", "application/group-python-serialize"}:
        warnings.filterwarnings("ignore", message="You're running the worker with superuser", category=SecurityWarning)


class JobTask(Task):
    """The class of the tasks that run jobs and nodes of jobs. Their pool process has one
    launcher, and with it one warm start, made when the process starts and used by every job
    and node it runs. It is kept on this class, not on a task: Celery makes an instance per
    task, and a launcher per task gave a worker that ran both kinds a second warm start (seconds
    of CPU and the memory of torch, DeepSpeed and transformers, twice)."""

    _launcher: ClassVar[Launcher | None] = None

    @staticmethod
    def process_launcher() -> Launcher:
        """This process's launcher, made on the first call."""
        if JobTask._launcher is None:
            JobTask._launcher = Launcher(hardware=current_hardware(), settings=get_settings())
        return JobTask._launcher


@celery_app.task(name=RUN_JOB_TASK, base=JobTask)
def run_job_task(job_id: str) -> None:
    _note_stops()
    if _stopping.is_set() or check_disk() is not None:
        # Not claimed: a reconciler publishes it again, to a live worker (this one is not, now).
        if _stopping.is_set():
            # Said, because a SIGTERM that reached this pool process alone (not the worker's
            # main process) leaves it taking no job until the worker is restarted.
            logger.warning("worker %s was asked to stop: job %s goes back to the queue", _worker_id, job_id)
        with session_scope() as session:
            mark_unpublished(session=session, job_id=uuid.UUID(job_id))
        return
    _while_busy(
        lambda launcher: run_job(
            uuid.UUID(job_id), settings=get_settings(), launcher=launcher, worker_id=_worker_id, stopping=_stopping
        ),
    )


@celery_app.task(name=RUN_NODE_TASK, base=JobTask)
def run_node_task(job_id: str, attempt: int, node_rank: int) -> None:
    """One node of a multi-node job, placed on this worker (shared.db.gangs). A worker that
    stops or whose disk is full does not start it: the gang's start deadline releases it."""
    _note_stops()
    if _stopping.is_set() or check_disk() is not None:
        return
    _while_busy(
        lambda launcher: run_node(
            uuid.UUID(job_id),
            attempt=attempt,
            node_rank=node_rank,
            settings=get_settings(),
            launcher=launcher,
            worker_id=_worker_id,
            stopping=_stopping,
        ),
    )


def _while_busy(run: Callable[[Launcher], None]) -> None:
    """Run a job (or a node of one) with the pool process's launcher, this worker marked busy
    meanwhile, then idle again."""
    with session_scope() as session:
        set_worker_idle(session=session, worker_id=_worker_id, idle=False)
    try:
        run(JobTask.process_launcher())  # made here when outside a pool process (Celery's solo pool)
    except SystemExit as stop:
        # The runner hands the job back on a SIGTERM and exits. On a stop of the worker, the
        # task ends here instead, as any task does, and Celery stops this process with the
        # pool: a SystemExit out of a task is, to Celery, its pool process dying under it
        # (`ERROR ... WorkerLostError('Worker exited prematurely: exitcode 0.')` and a
        # traceback). A SIGTERM that reached this pool process alone still ends it, and Celery
        # starts another in its place.
        if stop.code not in (0, None) or not _worker_is_stopping():
            raise
        logger.info("worker %s: the job was handed back; the pool process stops with the worker", _worker_id)
    finally:
        _idle_again()


def _worker_is_stopping() -> bool:
    """Whether the worker's main process is shutting down (or does within
    MAIN_PROCESS_STOP_WAIT_SECONDS)."""
    deadline = time.monotonic() + MAIN_PROCESS_STOP_WAIT_SECONDS
    while not _main_process_stopping[0]:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _idle_again() -> None:
    """This worker is free: say so, and place the gangs that may now start (the oldest waiting
    one holds it first), instead of leaving them to the next reconciler pass."""
    with session_scope() as session:
        set_worker_idle(session=session, worker_id=_worker_id, idle=True)
        place_and_start(session=session, settings=get_settings())
