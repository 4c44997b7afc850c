"""Fixtures shared by every test: a fresh TUNEQ_HOME, real databases, a tiny local model.

Tests that need Postgres or Redis skip when those are down, except under
``TUNEQ_REQUIRE_SERVICES=1`` (set by .ci/run), where they fail instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from cli.samples import build_tiny_model, write_text_dataset
from tests.services import drop_fresh_schemas, fresh_postgres_schema
from tests.xdist_scheduling import pytest_xdist_make_scheduler as pytest_xdist_make_scheduler

POSTGRES_URL = os.environ.get("TUNEQ_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# pytest-xdist runs tests in several processes (`make test`): each gets a Redis database of its
# own (15, 13, ...; the soak uses 14, and flushes it). Each service's queues are named after its
# home (tests/e2e/harness.py), and Postgres needs nothing: every test makes a schema of its own.
_XDIST_INDEX = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
REDIS_URL = os.environ.get("TUNEQ_TEST_REDIS_URL", f"redis://127.0.0.1:6379/{15 - 2 * _XDIST_INDEX}")
# How long a job's all-reduce buffers may outlive its ranks: the worker removes them at its
# next poll (about a second), and a job of a test running beside this one may be in between.
BUFFER_REMOVAL_GRACE_SECONDS = 15.0
# One thread per rank (and per test process): the launcher's default gives a 1-rank job every
# core, and `make test` runs three test processes, each with jobs, on this 2-core machine. With more
# OpenMP threads than free cores, threads spin waiting for each other: a tiny model's job then
# takes 2-5 times the CPU (and time) for the same steps. A job's own OMP_NUM_THREADS still wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One API process for each `tuneq serve` the tests start, as before TUNEQ_API_WORKERS: its default
# (the host's cores) would double every server's start on this 2-core machine, and the tests of
# several processes (tests/cli/test_serve.py) ask for them with --workers.
os.environ.setdefault("TUNEQ_API_WORKERS", "1")


# First: pytest-xdist's own hook (in each test process) reads the xdist_group markers added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow (end-to-end) tests first, in their order: with several test processes the
    longest files start at once and the quick ones fill the gaps, instead of a long file
    starting last and running alone.

    ``make test`` distributes by group (``--dist loadgroup``): a file's tests stay in one test
    process, so a service its module fixture starts is started once, except in files marked
    ``spread``, whose tests each start their own services and mostly wait (for a lease to
    expire, a store to come back): those go one by one to whichever process is free, except
    the ones a spread file groups itself (``xdist_group``) around a service they share."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        if item.get_closest_marker("spread") is None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.partition("::")[0]))


def pytest_sessionfinish() -> None:
    """Each test process drops the Postgres schemas its tests made, its services all stopped."""
    drop_fresh_schemas()


def require_service(name: str, reason: str) -> None:
    if os.environ.get("TUNEQ_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{name} is required (TUNEQ_REQUIRE_SERVICES=1) but unavailable: {reason}")
    pytest.skip(f"{name} unavailable: {reason}")


def clear_caches() -> None:
    from shared.db.engine import get_engine
    from shared.queue import get_celery
    from shared.settings import get_settings

    if get_engine.cache_info().currsize:
        get_engine().dispose()
    get_engine.cache_clear()
    get_celery.cache_clear()
    get_settings.cache_clear()


@pytest.fixture(autouse=True)
def no_leaked_allreduce_buffers() -> Iterator[None]:
    """Every test leaves /dev/shm as it found it: a job's ranks each create a 66 MB DeepSpeed
    all-reduce buffer there, which tuneq must remove whatever the job's outcome."""
    from worker.shm_buffers import BUFFER_PREFIX, SHM_DIR, mapped_paths

    pattern = f"{BUFFER_PREFIX}_{os.getuid()}_*"
    before = set(SHM_DIR.glob(pattern))
    yield
    deadline = time.monotonic() + BUFFER_REMOVAL_GRACE_SECONDS
    while True:
        # A job still running (in a service shared with later tests, or in a test running
        # beside this one) maps its own; one whose ranks just ended has its removed in a moment.
        new = set(SHM_DIR.glob(pattern)) - before
        mapped = mapped_paths() if new else set()
        leaked = sorted(str(p) for p in new if p.exists() and str(p) not in mapped)
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not leaked, f"jobs of this test (or of one beside it) left DeepSpeed all-reduce buffers behind: {leaked}"


class FakeClock:
    """Stands in for the ``time`` module of shared.artifacts.store (``store_clock``): a sleep
    moves it on at once, so a test of the store's backoff counts seconds without waiting them."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def store_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The artifact store's backoff (``StoreOutage``) on a FakeClock."""
    from shared.artifacts import store

    clock = FakeClock()
    monkeypatch.setattr(store, "time", clock)
    return clock


@pytest.fixture
def tuneq_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    monkeypatch.setenv("TUNEQ_HOME", str(home))
    for var in ("TUNEQ_DATABASE_URL", "TUNEQ_BROKER_URL", "TUNEQ_ALLOWED_ROOTS"):
        monkeypatch.delenv(var, raising=False)
    # An app served other than by `tuneq serve` on loopback requires API keys; tests/api/test_auth.py
    # turns them on, everything else runs as owner "local".
    monkeypatch.setenv("TUNEQ_AUTH", "off")
    clear_caches()
    yield home
    clear_caches()


@pytest.fixture(scope="session")
def postgres_url() -> str:
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(POSTGRES_URL)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as e:
        require_service("PostgreSQL", f"{make_url(POSTGRES_URL).render_as_string()}: {e}")
    return POSTGRES_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as e:
        require_service("Redis", f"{REDIS_URL}: {e}")
    return REDIS_URL


@pytest.fixture
def model_dir(tuneq_home: Path) -> Path:
    """A stand-in model directory under the allowed root: enough for submit-time checks."""
    path = tuneq_home / "data" / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x")
    return path


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database_url(request: pytest.FixtureRequest, tuneq_home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty database (SQLite file, or a fresh Postgres schema), as TUNEQ_DATABASE_URL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tuneq_home / 'tuneq.sqlite'}"
    else:
        url = fresh_postgres_schema(request.getfixturevalue("postgres_url"))
    monkeypatch.setenv("TUNEQ_DATABASE_URL", url)
    clear_caches()
    return url


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite database migrated to head once per test process, which each test copies."""
    from shared.db.engine import migrate_database

    path = tmp_path_factory.mktemp("migrated") / "tuneq.sqlite"
    migrate_database(f"sqlite:///{path}")  # its last connection closed: the WAL is in the file
    assert not path.with_name("tuneq.sqlite-wal").exists()
    return path


@pytest.fixture
def database_url(empty_database_url: str, request: pytest.FixtureRequest) -> str:
    """Each test that takes this runs on the embedded SQLite and on a real Postgres, migrated to
    head: the schema comes from the migrations, as in production (SQLite's a copy of a database
    they made, a tenth of the CPU of migrating each test's)."""
    import shutil

    from shared.db.engine import init_db, migrate_database

    if empty_database_url.startswith("sqlite"):
        shutil.copyfile(request.getfixturevalue("migrated_sqlite"), make_url(empty_database_url).database or "")
    else:
        migrate_database(empty_database_url)
    init_db()  # which checks the revision
    return empty_database_url


@pytest.fixture(scope="session")
def tiny_model_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gpt-neo")


@pytest.fixture
def tiny_model(tuneq_home: Path, tiny_model_template: Path) -> Path:
    """The tiny model, copied inside this test's allowed root."""
    import shutil

    target = tuneq_home / "data" / "tiny-gpt-neo"
    shutil.copytree(tiny_model_template, target)
    return target


@pytest.fixture
def text_dataset(tuneq_home: Path) -> Path:
    return write_text_dataset(tuneq_home / "data" / "train.jsonl", records=64)
