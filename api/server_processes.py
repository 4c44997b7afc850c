"""How ``tuneq serve`` runs the API: one process, or several on one listening socket.

One Python process serves requests on one core at a time (the interpreter lock), so under load
its CPU is the limit: a submit costs milliseconds of it, a poll a third of one (BENCHMARKS.md,
B9). ``TUNEQ_API_WORKERS`` (``tuneq serve --workers``) runs that many API processes instead.
uvicorn's own ``workers=`` would start plain uvicorn servers, without ``tuneq serve``'s stop
handling (``api.server_stop``), so this module is the supervisor: it binds the socket once,
starts the processes (spawned: a fresh interpreter each, no copied threads or connections), each
running :class:`~api.server_stop.StoppingServer` on that socket, and then only watches them:

- SIGTERM or SIGINT to it is passed on to every process as SIGTERM: each stops as one process
  does (``TUNEQ_API_STOP_GRACE_SECONDS``, then 503 with Retry-After for what is left), and the
  supervisor waits for all of them, then exits 0. The processes ignore SIGINT themselves: a
  terminal's Ctrl-C reaches the whole process group, and the supervisor's SIGTERM is what stops
  them (a second SIGINT would make uvicorn skip the grace).
- A process that ends before any stop was asked for (it crashed, or was killed) is not
  restarted: the others are stopped and the supervisor exits 1, for the process manager
  (systemd, Docker, Kubernetes) to restart the whole server.
- A process whose supervisor dies (SIGKILL) gets SIGTERM (Linux), so none is left serving.

What each process holds for itself, and how it is kept right:

- ``GET /jobs/{id}``'s read cache (``api.read_cache``): a change one process makes (a cancel,
  a pause) is counted in shared memory (:class:`ProcessChanges`), and every process then reads
  again, so one server's processes never answer from before a change one of them made.
- The request latency histogram of ``/metrics``: prometheus_client's multiprocess mode
  (``PROMETHEUS_MULTIPROC_DIR``, a directory made for this server and removed when it stops),
  so a scrape, whichever process answers it, counts every process's requests.
- Its own plan child, database pool (up to ``shared.db.engine.POOL_SIZE`` connections) and
  ~360 MB of memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from api.metrics import METRICS_DIR_VARIABLE
from api.server_stop import StoppingServer
from shared.settings import get_settings

logger = logging.getLogger(__name__)

# After the stop grace: how long a process may take to answer what the grace cut off, stop its
# plan child and end, before the supervisor kills it.
STOP_MARGIN_SECONDS = 30.0
# How often the supervisor looks at its processes besides when one ends or a signal comes.
WATCH_SECONDS = 1.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def server_config(app: Any, *, host: str, port: int) -> uvicorn.Config:
    """The uvicorn configuration of every API process of ``tuneq serve``."""
    # On SIGTERM uvicorn waits for open requests; a plan in flight (minutes) or a client that
    # keeps a stream open must not hold the server past its stop grace. What the grace cuts off,
    # and what arrives once the stop began, is answered 503 with Retry-After (api.server_stop).
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=get_settings().api_stop_grace_seconds,
        # asyncio's loop, not uvloop: uvloop's libuv accepts one connection per loop turn, so
        # under load a burst of new connections waited seconds to be accepted (BENCHMARKS.md, B9).
        loop="asyncio",
    )


def serve_one_process(*, host: str, port: int) -> None:
    """The API in this process (``TUNEQ_API_WORKERS=1``), until a stop signal."""
    from api.main import app

    StoppingServer(server_config(app, host=host, port=port), stop=app.state.server_stop).run()


class ProcessChanges:
    """The changes each API process of one server made, one count a process in shared memory
    (a ``multiprocessing`` array), for ``api.read_cache.ReadCache.share_changes``. Each process
    adds only to its own count, so no lock is needed, and their sum only grows."""

    def __init__(self, counts: Any, index: int) -> None:
        self._counts = counts  # ctypes array of unsigned 64-bit counts, one a process
        self._index = index

    def count(self) -> int:
        return sum(self._counts)

    def add(self) -> None:
        self._counts[self._index] += 1


class _SupervisedServer(StoppingServer):
    """An API process's server: stopped by the supervisor's SIGTERM, deaf to SIGINT (the module's text)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGINT:
            super().handle_exit(sig, frame)


def _stop_with_supervisor(supervisor: int) -> None:
    """Ask the kernel for SIGTERM when the supervisor dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logger.warning("could not ask to be stopped with the supervisor: errno %d", ctypes.get_errno())
    if os.getppid() != supervisor:  # it died before the request
        os.kill(os.getpid(), signal.SIGTERM)


def _api_process(listening: socket.socket, host: str, port: int, counts: Any, index: int, supervisor: int) -> None:
    """One API process (the target of a spawned ``multiprocessing`` process)."""
    _stop_with_supervisor(supervisor)
    from shared.logging_config import configure_logging

    configure_logging(get_settings(), request_ids=True)
    from api.main import app

    app.state.job_cache.share_changes(ProcessChanges(counts, index))
    config = server_config(app, host=host, port=port)
    _SupervisedServer(config, stop=app.state.server_stop).run(sockets=[listening])


class _Supervisor:
    """The API processes, and the stop signals the supervisor got."""

    def __init__(self) -> None:
        self.processes: list[SpawnProcess] = []
        self.stop_asked = False

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.stop_asked:
            logger.info("%s: stopping the API processes", signal.Signals(signum).name)
        self.stop_asked = True
        self.pass_stop_on()

    def pass_stop_on(self) -> None:
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    def start(self, listening: socket.socket, *, host: str, port: int, workers: int) -> None:
        context = multiprocessing.get_context("spawn")
        counts = context.RawArray(ctypes.c_uint64, workers)
        for index in range(workers):
            if self.stop_asked:  # stop() passes the stop on to those started
                return
            process = context.Process(
                target=_api_process,
                args=(listening, host, port, counts, index, os.getpid()),
                name=f"tuneq-api-{index + 1}",
            )
            process.start()
            self.processes.append(process)

    def watch(self) -> bool:
        """Wait for a stop signal, or for a process to end before any: True for the latter."""
        while not self.stop_asked:
            wait([p.sentinel for p in self.processes], timeout=WATCH_SECONDS)
            ended = [p for p in self.processes if p.exitcode is not None]
            if ended and not self.stop_asked:
                for process in ended:
                    logger.error(
                        "API process %s (pid %s) ended (exit %s): stopping the others",
                        process.name,
                        process.pid,
                        process.exitcode,
                    )
                return True
        return False

    def stop(self, *, timeout: float) -> bool:
        """SIGTERM to every process still running, and wait for them all; those still running
        after ``timeout`` are killed. True when every process ended by itself."""
        self.pass_stop_on()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        stuck = [p for p in self.processes if p.exitcode is None]
        for process in stuck:
            logger.error(
                "API process %s (pid %s) had not stopped after %.0f s: killed", process.name, process.pid, timeout
            )
            process.kill()
            process.join()
        return not stuck


def serve_processes(*, host: str, port: int, workers: int) -> int:
    """Run ``workers`` API processes on one socket until SIGTERM or SIGINT (the module's text).
    Returns the supervisor's exit status: 0 after a stop it was asked for, 1 when a process ended
    before that or had to be killed."""
    listening = uvicorn.Config("api.main:app", host=host, port=port).bind_socket()
    metrics_dir = Path(tempfile.mkdtemp(prefix="tuneq-api-metrics-"))
    os.environ[METRICS_DIR_VARIABLE] = str(metrics_dir)  # the processes inherit it
    supervisor = _Supervisor()
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, supervisor.on_signal) for sig in handled}
    failed = False
    try:
        supervisor.start(listening, host=host, port=port, workers=workers)
        # The processes have the socket; the supervisor accepts nothing, so its copy goes: once
        # they end, the port is free.
        listening.close()
        logger.info("%d API processes started: %s", workers, _pids(supervisor.processes))
        failed = supervisor.watch()
        timeout = get_settings().api_stop_grace_seconds + STOP_MARGIN_SECONDS
        failed = not supervisor.stop(timeout=timeout) or failed
    finally:
        listening.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.pop(METRICS_DIR_VARIABLE, None)
    logger.info("the API processes stopped")
    return 1 if failed else 0


def _pids(processes: Sequence[SpawnProcess]) -> str:
    return ", ".join(str(p.pid) for p in processes)
