"""The ``tuneq`` command: ``serve`` (API), ``worker`` (Celery), ``dev`` (both), ``demo``.

The API and the worker are named by import string here, so ``shared`` never imports them
at module level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

import typer

from shared.settings import get_settings

app = typer.Typer(help="tuneq: fine-tune language models with DeepSpeed, as jobs.", no_args_is_help=True)
logger = logging.getLogger("tuneq")

STOP_TIMEOUT_SECONDS = 30.0


def _configure_logging() -> None:
    level = os.environ.get("TUNEQ_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the HTTP API (uvicorn)."""
    import uvicorn

    _configure_logging()
    uvicorn.run("api.main:app", host=host, port=port, log_level="info", access_log=False)


@app.command()
def worker() -> None:
    """Run a Celery worker that claims and runs jobs, one at a time."""
    import importlib

    _configure_logging()
    tasks = importlib.import_module("worker.tasks")
    tasks.prepare_worker()
    settings = get_settings()
    tasks.celery_app.worker_main(
        [
            "worker",
            "--loglevel=INFO",
            "--pool=prefork",
            "--concurrency=1",
            f"--queues={settings.queue}",
            f"--hostname=tuneq-{os.getpid()}@{socket.gethostname()}",
            # Gossip and mingle need fanout exchanges, which the SQL broker lacks; jobs
            # coordinate through the database anyway.
            "--without-gossip",
            "--without-mingle",
        ]
    )


def _stop_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        _stop_group(child, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %s did not stop in time; killing it", child.pid)
    for child in children:
        _stop_group(child, signal.SIGKILL)
        child.wait()


@app.command()
def dev(host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the API and a worker together on the embedded default. Ctrl-C stops everything."""
    _configure_logging()
    from shared.db import init_db

    init_db()  # once, before two processes race to create the same tables
    me = [sys.executable, "-m", "shared.cli"]
    children = [
        subprocess.Popen([*me, "serve", "--host", host, "--port", str(port)], start_new_session=True),
        subprocess.Popen([*me, "worker"], start_new_session=True),
    ]
    stopping = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    logger.info("tuneq dev: API on http://%s:%d, worker started (home %s)", host, port, get_settings().home)
    code = 0
    while not stopping:
        if any(c.poll() is not None for c in children):
            logger.error("a tuneq process exited; stopping the others")
            code = 1
            break
        time.sleep(0.5)
    _stop_all(children)
    raise typer.Exit(code)


@app.command()
def demo(port: int = 0) -> None:
    """Build a tiny model and dataset, run the seed job on `tuneq dev`, print the loss curve."""
    from shared.demo import run_demo

    _configure_logging()
    raise typer.Exit(run_demo(port=port, echo=typer.echo))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
