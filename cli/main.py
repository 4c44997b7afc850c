"""The ``tuneq`` command: ``serve`` (API), ``worker`` (Celery), ``dev`` (both), ``migrate``, ``demo``,
and the HTTP client's ``submit``, ``jobs``, ``show``, ``logs``, ``cancel``, ``pause``, ``resume``,
``download`` (``cli.commands``).

``cli`` may import ``api`` and ``worker`` (nothing imports ``cli``); it does so inside the
commands that need them, so ``tuneq submit`` starts without loading the server or the worker.
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
from datetime import datetime
from types import FrameType

import typer

from cli.commands import register as register_client_commands
from shared.settings import get_settings

app = typer.Typer(help="tuneq: fine-tune language models with DeepSpeed, as jobs.", no_args_is_help=True)
logger = logging.getLogger("tuneq")

STOP_TIMEOUT_SECONDS = 30.0


def _configure_logging(*, request_ids: bool = False) -> None:
    """First step of every server command, so a bad setting stops it with a plain message
    (``request_ids``: the API's, whose lines say which request they are about)."""
    from pydantic import ValidationError

    from shared.logging_config import configure_logging

    try:
        settings = get_settings()
    except ValidationError as e:
        for error in e.errors():
            name = "TUNEQ_" + "_".join(str(part) for part in error["loc"]).upper()
            typer.echo(f"tuneq: {name}={error.get('input')!r}: {error['msg']}", err=True)
        raise typer.Exit(2) from None
    configure_logging(settings, request_ids=request_ids)


def _prepare_database() -> None:
    """The embedded default migrates itself; any other database must be migrated already.

    Refuses (exit 1, the reason on stderr, no traceback) when it is not, or cannot be reached.
    """
    from sqlalchemy.exc import OperationalError

    from shared.db.engine import DatabaseNotMigrated, display_url, init_db

    try:
        init_db()
    except DatabaseNotMigrated as e:
        typer.echo(f"tuneq: {e}", err=True)
        raise typer.Exit(1) from None
    except OperationalError as e:
        url = display_url(get_settings().database_url)
        typer.echo(f"tuneq: cannot reach the database at {url}: {e.orig or e}", err=True)
        raise typer.Exit(1) from None


def _check_artifact_store() -> None:
    """Refuse to start (exit 1, one line naming TUNEQ_ARTIFACTS_URI and the problem) when the
    artifact store cannot be written (a missing bucket, refused credentials, no endpoint), or
    is not the store the database records for this deployment (shared.db.store_identity: the
    first process to start records its own). After _prepare_database."""
    from shared.artifacts.store import ArtifactStore, ArtifactStoreError
    from shared.db.store_identity import claim_or_verify

    try:
        store = ArtifactStore.from_settings(get_settings())
        store.check()
        claim_or_verify(store)
    except ArtifactStoreError as e:
        typer.echo(f"tuneq: {e}", err=True)
        raise typer.Exit(1) from None


def _resolve_auth(host: str) -> None:
    """Settle TUNEQ_AUTH for an API on ``host``: "auto" is off on loopback, on elsewhere; "off"
    anywhere but loopback refuses to start (exit 1, one line). The app reads the result."""
    from shared.db.api_keys import is_loopback

    auth = get_settings().auth
    if auth == "off" and not is_loopback(host):
        typer.echo(
            f"tuneq: TUNEQ_AUTH=off is allowed only when the API listens on loopback (127.0.0.1, ::1, localhost), "
            f"not on {host}: leave auth on and create keys with `tuneq keys create --owner NAME`",
            err=True,
        )
        raise typer.Exit(1)
    if auth == "auto":
        os.environ["TUNEQ_AUTH"] = "off" if is_loopback(host) else "on"
        get_settings.cache_clear()
    if get_settings().auth_required:
        logger.info("the API requires keys (Authorization: Bearer); create them with `tuneq keys create`")
    else:
        logger.info("the API runs without keys (TUNEQ_AUTH off, on loopback): every job belongs to 'local'")


@app.command()
def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int | None = typer.Option(
        None, min=1, help="API processes on the one port (default TUNEQ_API_WORKERS: the host's cores, at most 4)."
    ),
) -> None:
    """Run the HTTP API (uvicorn). Off loopback it requires API keys (TUNEQ_AUTH)."""
    _configure_logging(request_ids=True)
    _resolve_auth(host)
    _prepare_database()
    _check_artifact_store()
    from api.server_processes import serve_one_process, serve_processes

    processes = workers or get_settings().api_worker_count
    if processes == 1:
        serve_one_process(host=host, port=port)
        return
    raise typer.Exit(serve_processes(host=host, port=port, workers=processes))


@app.command()
def worker() -> None:
    """Run a Celery worker that claims and runs jobs, one at a time."""
    from worker import tasks

    _configure_logging()
    _prepare_database()
    _check_artifact_store()
    queues = tasks.prepare_worker()
    tasks.celery_app.worker_main(
        [
            "worker",
            "--loglevel=INFO",
            "--pool=prefork",
            "--concurrency=1",
            # Its size's (jobs go to the smallest worker size that fits them) and its own (the
            # nodes of multi-node jobs placed on it).
            f"--queues={','.join(queues)}",
            f"--hostname=tuneq-{os.getpid()}@{socket.gethostname()}",
            # Gossip and mingle need fanout exchanges, which the SQL broker lacks; jobs
            # coordinate through the database anyway.
            "--without-gossip",
            "--without-mingle",
        ]
    )


@app.command("build-ops")
def build_ops() -> None:
    """Compile the DeepSpeed ops a worker's ranks load (CPU Adam, fused Adam; on a CPU host the
    shared-memory all-reduce) ahead of the first job, a line as each starts and ends."""
    from worker import launcher

    _configure_logging()
    launcher.build_ops(launcher.detect_hardware())


def _stop_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def _stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    # SIGTERM to each service's own process, as an init or `docker stop` sends it: the API
    # drains and stops its plan child, the worker stops (and releases) a running job in its
    # pool child and stops idle ones itself. What is left of either group after the grace is
    # killed with it.
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
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
    _resolve_auth(host)  # refuse here, before starting anything; `serve` settles it again
    _prepare_database()  # once, before the two processes start (they would take turns anyway)
    _check_artifact_store()
    stopping = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    # Before the children exist: a SIGTERM between their start and these handlers ended dev
    # by its default action and left the API and the worker running, orphaned.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    me = [sys.executable, "-P", "-m", "cli.main"]  # -P: see main()
    children = [
        # One API process: the embedded default serves one user, and each process costs a start.
        subprocess.Popen([*me, "serve", "--host", host, "--port", str(port), "--workers", "1"], start_new_session=True),
        subprocess.Popen([*me, "worker"], start_new_session=True),
    ]
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
def migrate() -> None:
    """Upgrade the database (TUNEQ_DATABASE_URL) to the newest schema and print its revision."""
    from alembic.util import CommandError
    from sqlalchemy.exc import OperationalError

    from shared.db.engine import DatabaseNotMigrated, display_url, migrate_database

    _configure_logging()
    logging.getLogger("alembic.runtime.migration").setLevel(logging.getLogger().level)  # "Running upgrade ..."
    url = display_url(get_settings().database_url)
    try:
        revision = migrate_database()
    except CommandError as e:  # e.g. a revision this tuneq does not know: a newer one migrated it
        typer.echo(f"tuneq: cannot migrate the database at {url}: {e}", err=True)
        raise typer.Exit(1) from None
    except DatabaseNotMigrated as e:  # tables from before migrations that are not the first revision's
        typer.echo(f"tuneq: {e}", err=True)
        raise typer.Exit(1) from None
    except OperationalError as e:
        typer.echo(f"tuneq: cannot reach the database at {url}: {e.orig or e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"the database at {url} is at revision {revision} (head)")


keys_app = typer.Typer(
    help="API keys (run where the server runs: these talk to TUNEQ_DATABASE_URL directly).", no_args_is_help=True
)
app.add_typer(keys_app, name="keys")


def _keys_database() -> None:
    """Keys live in the same database as the jobs: migrated as for `serve`, or refuse."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    _prepare_database()


@keys_app.command("create")
def keys_create(
    owner: str = typer.Option(..., help="Who the key's jobs belong to."),
    admin: bool = typer.Option(False, "--admin", help="An admin's key: sees, cancels and pauses every owner's job."),
) -> None:
    """Create a key for OWNER and print it, once: only its hash is stored."""
    from shared.db.api_keys import InvalidOwner, create_key
    from shared.db.engine import session_scope

    _keys_database()
    try:
        with session_scope() as session:
            row, key = create_key(session=session, owner=owner, admin=admin)
    except InvalidOwner as e:
        typer.echo(f"tuneq: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(key)
    kind = "an admin's key" if row.admin else "key"
    typer.echo(
        f"{kind} {row.id} for owner {row.owner}: send it as 'Authorization: Bearer <key>'; it is not shown again",
        err=True,
    )


@keys_app.command("list")
def keys_list() -> None:
    """The keys: id, owner, admin or not, created, last used, revoked."""
    from shared.db.api_keys import list_keys
    from shared.db.engine import session_scope

    _keys_database()
    with session_scope() as session:
        rows = list_keys(session=session)

    def when(value: datetime | None) -> str:
        return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else "-"

    table = [("ID", "OWNER", "ADMIN", "CREATED", "LAST USED", "REVOKED")]
    table += [
        (r.id, r.owner, "yes" if r.admin else "-", when(r.created_at), when(r.last_used_at), when(r.revoked_at))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., metavar="ID", help="The key's id, as `tuneq keys list` shows it."),
) -> None:
    """Revoke a key: requests with it get 401 from now on. Its owner's jobs stay."""
    from shared.db.api_keys import revoke_key
    from shared.db.engine import session_scope

    _keys_database()
    with session_scope() as session:
        row = revoke_key(session=session, key_id=key_id)
    if row is None:
        typer.echo(f"tuneq: no key {key_id} (see `tuneq keys list`)", err=True)
        raise typer.Exit(1)
    typer.echo(f"key {row.id} of owner {row.owner} is revoked")


@app.command()
def demo(port: int = 0) -> None:
    """Build a tiny model and dataset, run the seed job on `tuneq dev`, print the loss curve."""
    from cli.demo import run_demo

    _configure_logging()
    raise typer.Exit(run_demo(port=port, echo=typer.echo))


register_client_commands(app)


def main() -> None:
    # Every process tuneq starts (`python -m` children, the warm start, DeepSpeed's launcher and
    # ranks, probes) would otherwise put its working directory first on sys.path, where a
    # user's own shared/, api/ or worker/ folder shadows tuneq's packages (Python 3.11+).
    os.environ["PYTHONSAFEPATH"] = "1"
    app()


if __name__ == "__main__":
    main()
