"""The schema comes from Alembic migrations, and processes start only on a migrated database.

``test_upgrade_head_matches_the_models`` is the guard for ``shared/db/models.py``: a table or
column changed there without a migration (``alembic revision --autogenerate``, see
ARCHITECTURE.md) fails it, on SQLite and on Postgres.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

from shared.db.engine import (
    INITIAL_REVISION,
    DatabaseNotMigrated,
    alembic_config,
    current_revisions,
    database_revision_problem,
    display_url,
    head_revisions,
    init_db,
    make_migration_engine,
    migrate_database,
    script_directory,
)
from shared.ports import free_port
from tests.conftest import clear_caches
from tests.services import fresh_postgres_schema
from tests.together import run_together

ROOT = Path(__file__).resolve().parents[3]
HEAD = ", ".join(head_revisions())
TABLES = {"jobs", "job_events", "job_metrics", "checkpoints", "workers", "api_keys", "files"}


@pytest.fixture
def empty_postgres_url(tuneq_home: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    url = fresh_postgres_schema(postgres_url)
    monkeypatch.setenv("TUNEQ_DATABASE_URL", url)
    clear_caches()
    return url


@pytest.fixture
def engine(empty_database_url: str) -> Iterator[Engine]:
    with migration_engine(empty_database_url) as engine:
        yield engine


@contextmanager
def migration_engine(url: str) -> Iterator[Engine]:
    """``make_migration_engine(url)``, disposed of on leaving, so no connection outlives its use."""
    engine = make_migration_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


def schema_differences(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(context, SQLModel.metadata))


def table_names(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(inspect(conn).get_table_names())


def revisions(engine: Engine) -> tuple[str, ...]:
    with engine.connect() as conn:
        return current_revisions(conn)


def postgres_enums(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
                "WHERE t.typtype = 'e' AND n.nspname = current_schema()"
            )
        )
        return {row[0] for row in rows}


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        env={**os.environ, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- the migrations build exactly the models' schema ------------------------------------


def test_upgrade_head_matches_the_models(engine: Engine) -> None:
    config = alembic_config(engine.url)
    command.upgrade(config, "head")
    assert table_names(engine) >= TABLES
    assert revisions(engine) == head_revisions()
    assert schema_differences(engine) == [], "models.py changed without a migration: see docs/development.md"

    command.downgrade(config, "base")
    assert table_names(engine) <= {"alembic_version"}
    assert revisions(engine) == ()
    if engine.dialect.name == "postgresql":
        assert postgres_enums(engine) == set()  # downgrade leaves no enum type behind

    command.upgrade(config, "head")
    assert schema_differences(engine) == []
    assert database_revision_problem(engine) is None


def schema_snapshot(engine: Engine) -> dict[str, Any]:
    """What reflection sees, table by table: enough to tell a downgrade that undid too little or too much."""
    with engine.connect() as conn:
        inspector = inspect(conn)
        snapshot: dict[str, Any] = {
            table: {
                "columns": [(c["name"], str(c["type"]), c["nullable"]) for c in inspector.get_columns(table)],
                "pk": inspector.get_pk_constraint(table)["constrained_columns"],
                "indexes": sorted(
                    (i["name"], tuple(i["column_names"]), i["unique"]) for i in inspector.get_indexes(table)
                ),
                "unique": sorted(tuple(u["column_names"]) for u in inspector.get_unique_constraints(table)),
                "foreign_keys": sorted(
                    (tuple(f["constrained_columns"]), f["referred_table"], tuple(f["referred_columns"]))
                    for f in inspector.get_foreign_keys(table)
                ),
            }
            for table in inspector.get_table_names()
            if table != "alembic_version"
        }
        if engine.dialect.name == "postgresql":
            snapshot["enum types"] = {e["name"]: e["labels"] for e in inspector.get_enums()}  # Postgres only
    return snapshot


def test_postgres_enum_types_have_the_python_values(empty_postgres_url: str) -> None:
    """Autogenerate does not compare enum values: a value added in Python needs ALTER TYPE ... ADD VALUE."""
    import sqlalchemy as sa

    migrate_database(empty_postgres_url)
    expected = {
        column.type.name: list(column.type.enums)
        for table in SQLModel.metadata.tables.values()
        for column in table.columns
        if isinstance(column.type, sa.Enum) and column.type.name
    }
    assert expected  # JobStatus, EventType, CheckpointKind
    with migration_engine(empty_postgres_url) as engine, engine.connect() as conn:
        enums = inspect(conn).get_enums()  # the Postgres inspector's
    assert {e["name"]: list(e["labels"]) for e in enums} == expected


def test_each_downgrade_undoes_its_upgrade(engine: Engine) -> None:
    config = alembic_config(engine.url)
    order = [script.revision for script in reversed(list(script_directory().walk_revisions()))]
    snapshots = [schema_snapshot(engine)]
    for revision in order:
        command.upgrade(config, revision)
        snapshots.append(schema_snapshot(engine))
    for revision, before in zip(reversed(order), reversed(snapshots[:-1]), strict=True):
        command.downgrade(config, "-1")
        assert schema_snapshot(engine) == before, f"downgrading {revision}"
    assert revisions(engine) == ()


def test_downgrading_pause_keeps_paused_and_pausing_jobs_alive(engine: Engine) -> None:
    """0013's downgrade: the older code knows neither status, so a pausing job runs on and a
    paused one is queued again (unpublished, for a reconciler), never lost or ended."""
    from sqlmodel import Session

    from shared.db.models import Job, utcnow
    from shared.jobs.status import JobStatus

    config = alembic_config(engine.url)
    command.upgrade(config, "head")  # the rows are written as the code writes them; later downgrades run first
    with Session(engine) as session:
        for name, status in (("pausing", JobStatus.pausing), ("paused", JobStatus.paused)):
            job = Job(name=name, status=status, model="m", dataset="d", deepspeed_config={}, num_gpus=1, training={})
            job.enqueued_at = utcnow()
            session.add(job)
        session.commit()
    command.downgrade(config, "0012")
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, status, enqueued_at FROM jobs ORDER BY name")).all()
    assert [(name, status, enqueued is None) for name, status, enqueued in rows] == [
        ("paused", "queued", True),
        ("pausing", "running", False),
    ]


def test_downgrading_preference_metrics_keeps_each_step_and_drops_the_phases(engine: Engine) -> None:
    """0021 both ways with rows: a DPO step's row stays (its loss) without its DPO measures, the
    phase events go (the older eventtype has no such value), and upgrading again takes them."""
    from sqlmodel import Session

    from shared.db.models import EventType, Job, JobEvent, JobMetric, utcnow

    config = alembic_config(engine.url)
    command.upgrade(config, "head")
    phase = {"name": "reference_logps", "done": 3, "total": 8, "cached": False}
    with Session(engine) as session:
        job = Job(model="m", dataset="d", deepspeed_config={}, num_gpus=1, training={}, phase=phase)
        session.add(job)
        job_id = job.id
        session.flush()
        session.add(JobMetric(job_id=job_id, step=1, loss=0.69, rewards_margins=0.25, time=utcnow()))
        session.add(JobEvent(job_id=job_id, type=EventType.phase, data=phase))
        session.add(JobEvent(job_id=job_id, type=EventType.log, data={"line": "kept"}))
        session.commit()
    command.downgrade(config, "0020")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT step, loss FROM job_metrics")).all() == [(1, 0.69)]
        assert conn.execute(text("SELECT type FROM job_events")).scalars().all() == ["log"]
    command.upgrade(config, "head")
    assert schema_differences(engine) == []
    with Session(engine) as session:
        session.add(JobEvent(job_id=job_id, type=EventType.phase, data=phase))
        session.commit()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT rewards_margins FROM job_metrics")).all() == [(None,)]


def test_enums_are_stored_as_the_code_reads_them(database_url: str) -> None:
    """``JobStatus`` and friends keep SQLModel's storage: a native enum on Postgres, text on SQLite."""
    import uuid

    from sqlmodel import Session

    from shared.db.engine import get_engine
    from shared.db.models import Job
    from shared.jobs.status import JobStatus

    job_id = uuid.uuid4()
    with Session(get_engine()) as session:
        session.add(Job(id=job_id, model="m", dataset="d", deepspeed_config={}, num_gpus=1, training={}))
        session.commit()
    with get_engine().connect() as conn:
        stored = conn.execute(text("SELECT status FROM jobs")).scalar_one()
        status = next(c for c in inspect(conn).get_columns("jobs") if c["name"] == "status")
    assert stored == "queued"
    if database_url.startswith("postgresql"):
        assert status["type"].name == "jobstatus"  # the native enum type create_all made
    with Session(get_engine()) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status is JobStatus.queued


def test_alembic_command_upgrades_with_the_repository_ini(empty_database_url: str) -> None:
    """What a compose `migrate` service runs: `alembic upgrade head` with TUNEQ_DATABASE_URL."""
    env = {**os.environ, "TUNEQ_DATABASE_URL": empty_database_url}
    done = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    current = subprocess.run(
        [sys.executable, "-m", "alembic", "current"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert f"{HEAD} (head)" in current.stdout, current.stdout + current.stderr
    with migration_engine(empty_database_url) as engine:
        assert schema_differences(engine) == []


def test_tuneq_migrate_needs_no_checkout(empty_database_url: str, tmp_path: Path) -> None:
    """The installed command migrates from anywhere: its config is built in code, not read from alembic.ini."""
    done = cli("migrate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"at revision {HEAD} (head)" in done.stdout
    assert "alembic.ini" not in os.listdir(tmp_path)
    again = cli("migrate", cwd=tmp_path)  # nothing left to do
    assert again.returncode == 0, again.stderr
    with migration_engine(empty_database_url) as engine:
        assert database_revision_problem(engine) is None


def test_a_database_from_before_migrations_is_adopted(engine: Engine) -> None:
    """Tables a tuneq created with create_all (the first revision's schema, no alembic_version)."""
    config = alembic_config(engine.url)
    command.upgrade(config, INITIAL_REVISION)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE alembic_version"))
    problem = database_revision_problem(engine)
    assert problem is not None and "before tuneq had migrations" in problem and "tuneq migrate" in problem

    assert migrate_database(engine.url) == HEAD
    assert schema_differences(engine) == []


def test_tables_from_before_migrations_with_another_schema_are_not_adopted(engine: Engine) -> None:
    config = alembic_config(engine.url)
    command.upgrade(config, INITIAL_REVISION)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE alembic_version"))
        conn.execute(text("ALTER TABLE job_metrics DROP COLUMN eval_loss"))  # as an older tuneq made it
    with pytest.raises(
        DatabaseNotMigrated, match=r"created before tuneq had migrations.*missing job_metrics\.eval_loss"
    ):
        migrate_database(engine.url)
    assert revisions(engine) == ()  # left as it was
    refused = cli("migrate")
    assert refused.returncode == 1
    assert "cannot be adopted" in refused.stderr and "Traceback" not in refused.stderr


def test_postgres_tables_from_before_migrations_need_the_enum_values_too(empty_postgres_url: str) -> None:
    with migration_engine(empty_postgres_url) as engine:
        command.upgrade(alembic_config(engine.url), INITIAL_REVISION)
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE alembic_version"))
            conn.execute(text("ALTER TYPE eventtype RENAME TO eventtype_old"))
            conn.execute(text("CREATE TYPE eventtype AS ENUM ('status', 'metric')"))
            conn.execute(text("ALTER TABLE job_events ALTER COLUMN type TYPE eventtype USING type::text::eventtype"))
        with pytest.raises(DatabaseNotMigrated, match=r"enum eventtype values.*cannot be adopted"):
            migrate_database(engine.url)


# ---- the startup rule -------------------------------------------------------------------


def test_the_problem_names_the_revisions_and_the_fix(engine: Engine) -> None:
    problem = database_revision_problem(engine)
    assert problem is not None
    assert f"is not migrated (at revision none, head is {HEAD})" in problem
    assert "run `tuneq migrate` (or `alembic upgrade head`)" in problem

    migrate_database(engine.url)
    assert database_revision_problem(engine) is None

    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed'"))
    problem = database_revision_problem(engine)
    assert problem is not None and "f00dfeed, which this tuneq does not know" in problem
    with pytest.raises(DatabaseNotMigrated, match="f00dfeed, which this tuneq does not know"):
        migrate_database(engine.url)  # nor does it touch it


def test_messages_hide_the_password() -> None:
    assert (
        display_url("postgresql+psycopg://tuneq:s3cret@db:5432/tuneq") == "postgresql+psycopg://tuneq:***@db:5432/tuneq"
    )


def test_the_embedded_default_migrates_itself(tuneq_home: Path) -> None:
    assert not (tuneq_home / "tuneq.sqlite").exists()
    init_db()
    with migration_engine(f"sqlite:///{tuneq_home / 'tuneq.sqlite'}") as engine:
        assert revisions(engine) == head_revisions()
        assert schema_differences(engine) == []
    init_db()  # and again: at head already


def test_a_server_database_is_checked_not_migrated(empty_postgres_url: str) -> None:
    with pytest.raises(DatabaseNotMigrated, match=r"not migrated .* run `tuneq migrate`"):
        init_db()
    with migration_engine(empty_postgres_url) as engine:
        assert table_names(engine) == set()  # refusing changed nothing
    migrate_database()
    init_db()


def test_embedded_processes_starting_together_all_migrate(tmp_path: Path) -> None:
    for round_ in range(3):
        home = tmp_path / f"home{round_}"
        env = {**os.environ, "TUNEQ_HOME": str(home)}
        env.pop("TUNEQ_DATABASE_URL", None)
        run_together("from shared.db.engine import init_db", "init_db()", env=env, n=4)
        with migration_engine(f"sqlite:///{home / 'tuneq.sqlite'}") as engine:
            assert revisions(engine) == head_revisions()
            assert schema_differences(engine) == []


def test_postgres_migrators_take_turns(empty_postgres_url: str) -> None:
    run_together("from shared.db.engine import migrate_database", "migrate_database()", env={**os.environ}, n=3)
    with migration_engine(empty_postgres_url) as engine:
        assert revisions(engine) == head_revisions()
        assert schema_differences(engine) == []


# ---- the real processes -----------------------------------------------------------------


def _wait_ready(process: subprocess.Popen[str], port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError("tuneq serve did not become ready")


def _serve(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _stop(process: subprocess.Popen[str]) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _serve_until_ready() -> None:
    """Start ``tuneq serve``, wait until it answers /readyz (past its database check), stop it."""
    port = free_port()
    server = _serve(port)
    try:
        _wait_ready(server, port)
    finally:
        _stop(server)


def test_serve_on_the_embedded_default_migrates_it(tuneq_home: Path) -> None:
    _serve_until_ready()
    with migration_engine(f"sqlite:///{tuneq_home / 'tuneq.sqlite'}") as engine:
        assert revisions(engine) == head_revisions()


def test_serve_and_worker_refuse_an_unmigrated_postgres_until_migrated(empty_postgres_url: str) -> None:
    for args in (["serve", "--port", str(free_port())], ["worker"]):
        started = time.monotonic()
        refused = cli(*args, timeout=60)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert time.monotonic() - started < 30
        assert "is not migrated (at revision none" in refused.stderr
        assert "run `tuneq migrate`" in refused.stderr
        assert "Traceback" not in refused.stderr + refused.stdout

    migrated = cli("migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert f"at revision {HEAD} (head)" in migrated.stdout

    _serve_until_ready()
