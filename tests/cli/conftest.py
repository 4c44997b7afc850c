"""The client's test servers: a scripted one (``api``) and the real API (``served_api``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.fake_api import FakeApi
from tests.cli.served_api import ServedApi, serve_api


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


@pytest.fixture
def served_api(tuneq_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServedApi]:
    with serve_api(tuneq_home, tmp_path, monkeypatch) as served:
        yield served
