"""What several benchmarks share: real processes, a fresh Postgres schema, latency percentiles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
POSTGRES_URL = os.environ.get("TUNEQ_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TUNEQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")


def fresh_postgres_schema(url: str = POSTGRES_URL) -> str:
    """A URL whose connections use a new, empty ``bench_`` schema (the tests' own helper)."""
    from tests.services import fresh_postgres_schema as new_schema

    return new_schema(url, prefix="bench")


def drop_schema(url: str) -> None:
    import sqlalchemy
    from sqlalchemy import text

    schema = url.rsplit("search_path%3D", 1)[-1]
    if not schema.startswith("bench_"):
        return
    base = url.split("?", 1)[0]
    engine = sqlalchemy.create_engine(base)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    engine.dispose()


def tuneq_env(*, home: Path, database_url: str, broker_url: str = REDIS_URL) -> dict[str, str]:
    return {
        **os.environ,
        "TUNEQ_HOME": str(home),
        "TUNEQ_DATABASE_URL": database_url,
        "TUNEQ_BROKER_URL": broker_url,
        "TUNEQ_AUTH": "off",
    }


def migrate(env: dict[str, str], log: Path, *, cwd: Path = REPO) -> None:
    """``tuneq migrate``, of the checkout at ``cwd`` (give it ``PYTHONPATH`` too in ``env``)."""
    with log.open("ab") as out:
        subprocess.run(
            [sys.executable, "-m", "cli.main", "migrate"],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=120,
        )


class Server:
    """A real server process in its own session, stopped as a group. ``cwd``: the checkout it
    runs from (another one than this needs ``PYTHONPATH`` in ``env`` too)."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str], log: Path, port: int, cwd: Path = REPO) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                list(argv), env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.log = log

    def wait_ready(self, path: str, *, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log}")
            try:
                if httpx.get(self.base_url + path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready; see {self.log}")

    def wait_idle(self, *, below: float = 0.05, window: float = 2.0, timeout: float = 120) -> None:
        """Wait until the server's processes spend under ``below`` of a core over ``window``
        seconds: its start-up work (``tuneq serve`` imports DeepSpeed's config parser in a
        background thread after it answers, with pauses for I/O, hence a long window) is not
        measured as if it were the requests'."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            used = self.cpu_seconds()
            time.sleep(window)
            if self.cpu_seconds() - used < below * window:
                return
        raise TimeoutError(f"server still busy after {timeout:.0f} s; see {self.log}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the server's process and its children have used so far: a
        server of several processes (uvicorn's workers) counts them all."""
        import psutil

        root = psutil.Process(self.process.pid)
        total = 0.0
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:  # ended between the listing and the reading
                continue
            total += times.user + times.system
        return total

    def stop(self, *, timeout: float = 30) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def keep_log(log: Path, name: str) -> Path:
    """Copy a server log out of a temporary home, so a failure can be read afterwards."""
    import shutil
    import tempfile

    kept = Path(tempfile.gettempdir()) / "tuneq-bench-logs" / f"{name}-{int(time.time())}.log"
    kept.parent.mkdir(parents=True, exist_ok=True)
    if log.exists():
        shutil.copy(log, kept)
    return kept


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank: p99 of 1000 samples is the 990th smallest."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def metric_line(step: int, *, steps: int) -> str:
    """A rank's metric event for step ``step`` of ``steps``, as the worker ingests it, stamped
    with the time it is written (what an event's latency is measured from)."""
    return json.dumps(
        {
            "type": "metric",
            "step": step,
            "loss": 2.0 + 1 / step,
            "learning_rate": 3e-5,
            "grad_norm": 1.0,
            "epoch": step / steps,
            "tokens_per_second": 1000.0,
            "samples_per_second": 4.0,
            "tokens_seen": step * 512,
            "time": datetime.now(UTC).isoformat(),
        }
    )
