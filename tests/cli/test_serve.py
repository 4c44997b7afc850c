"""``tuneq serve``: the uvicorn server it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import uvicorn
from typer.testing import CliRunner

from api.server_stop import StoppingServer
from cli.main import app


def test_serve_runs_on_asyncios_event_loop(tuneq_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # uvloop's libuv accepts one connection a loop turn: under load, a burst of new connections
    # waited seconds to be accepted (BENCHMARKS.md, B9). asyncio's loop accepts them all at once.
    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(StoppingServer, "run", lambda server, sockets=None: configs.append(server.config))
    result = CliRunner().invoke(app, ["serve", "--port", "0"])
    assert result.exit_code == 0, result.output
    assert [config.loop for config in configs] == ["asyncio"]
