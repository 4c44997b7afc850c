"""``tuneq serve``: the uvicorn server it runs, in one process or several (api/server_processes.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
from typer.testing import CliRunner

from api.server_stop import StoppingServer
from cli.main import app
from cli.samples import seed_config
from shared.ports import free_port


def test_serve_runs_on_asyncios_event_loop(tuneq_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # uvloop's libuv accepts one connection a loop turn: under load, a burst of new connections
    # waited seconds to be accepted (BENCHMARKS.md, B9). asyncio's loop accepts them all at once.
    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(StoppingServer, "run", lambda server, sockets=None: configs.append(server.config))
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert [config.loop for config in configs] == ["asyncio"]


class Served:
    """A real ``tuneq serve --workers 2``, its API processes, and every request it answered."""

    def __init__(self, home: Path, **env: str) -> None:
        self.port = free_port()
        self.log = home / "serve.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "serve", "--port", str(self.port), "--workers", "2"],
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.answered: dict[str, int] = {}  # requests answered, by path

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """On a connection of its own, so whichever process accepts it answers."""
        answer = httpx.request(method, f"http://127.0.0.1:{self.port}{path}", timeout=30, **kwargs)
        self.answered[path] = self.answered.get(path, 0) + 1
        return answer

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if self.request("GET", "/healthz").status_code == 200:
                    return
            time.sleep(0.3)
        raise TimeoutError(self.log.read_text())

    def api_processes(self) -> list[psutil.Process]:
        children = psutil.Process(self.process.pid).children()
        return [c for c in children if "spawn_main" in " ".join(c.cmdline())]

    @contextlib.contextmanager
    def only(self, serving: psutil.Process) -> Iterator[None]:
        """Every other API process stopped (SIGSTOP): only ``serving`` accepts connections."""
        others = [p for p in self.api_processes() if p.pid != serving.pid]
        for other in others:
            other.suspend()
        try:
            yield
        finally:
            for other in others:
                other.resume()

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(psutil.Error):
                for process in self.api_processes():
                    process.resume()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def served(tuneq_home: Path) -> Iterator[Served]:
    # A read kept for a minute: only the processes' shared count of changes makes a cancel that
    # one process took show in the other at once.
    server = Served(tuneq_home, TUNEQ_JOB_CACHE_SECONDS="60")
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_serve_with_two_workers_answers_from_both_as_one_server_and_stops_them_all(
    served: Served, model_dir: Path, tuneq_home: Path
) -> None:
    first, second = served.api_processes()
    dataset = tuneq_home / "data" / "train.jsonl"
    dataset.write_text('{"text": "hello world"}\n')
    body = {"model": str(model_dir), "dataset": str(dataset), "deepspeed_config": seed_config(fp16=False)}
    # Each process answers alone, on the one port.
    with served.only(first):
        job = served.request("POST", "/jobs", json=body).json()
        assert served.request("GET", f"/jobs/{job['id']}").json()["status"] == "queued"  # now kept in first
    with served.only(second):
        assert served.request("POST", f"/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
        for _ in range(3):
            assert served.request("GET", "/healthz").status_code == 200
    with served.only(first):
        # The cancel second took shows in first at once, not after its minute-long read.
        assert served.request("GET", f"/jobs/{job['id']}").json()["status"] == "cancelled"
        # /metrics, from first, counts the requests both answered.
        metrics = served.request("GET", "/metrics").text
    healthz = 'tuneq_http_request_duration_seconds_count{method="GET",route="/healthz",status="200"}'
    counted = next(line for line in metrics.splitlines() if line.startswith(healthz))
    assert float(counted.rsplit(" ", 1)[1]) == served.answered["/healthz"]

    # SIGTERM to the supervisor alone stops every process, and frees the port.
    processes = [psutil.Process(served.process.pid), first, second]
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=60) == 0, served.log.read_text()
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive
    assert _port_is_free(served.port)


def test_serve_stops_every_worker_and_exits_1_when_one_dies(served: Served) -> None:
    first, second = served.api_processes()
    first.kill()
    assert served.process.wait(timeout=60) == 1, served.log.read_text()
    assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE
    assert "ended (exit -9): stopping the others" in served.log.read_text()
    assert _port_is_free(served.port)
