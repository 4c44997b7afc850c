"""``tuneq serve`` from a checkout, API keys on, on a fresh Postgres schema: what B11's two
benchmarks share (B11a, ``benchmarks/b11_jobs_list.py``; B11b, ``benchmarks/b11_followers.py``).

As B9 runs a tree (``benchmarks/b9_load.py``): the server's ``cwd`` and ``PYTHONPATH`` are the
checkout, with this interpreter's packages; the schema is migrated by that checkout's own
``tuneq migrate``, so an older tree gets its own indexes; the key is made by its ``tuneq keys
create``. Rows a benchmark needs are written between the migration and the server's start.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO, Server, drop_schema, fresh_postgres_schema, keep_log, migrate, tuneq_env
from shared.ports import free_port


@dataclass
class KeyedDeployment:
    server: Server
    key: str  # an API key of ``owner``
    owner: str
    database_url: str  # the fresh schema's
    home: Path
    tree: Path

    @property
    def authorization(self) -> str:
        """The header line every request sends."""
        return f"Authorization: Bearer {self.key}"


def _create_key(tree: Path, env: dict[str, str], owner: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "keys", "create", "--owner", owner],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"tuneq keys create failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout.strip()


@contextlib.contextmanager
def keyed_deployment(
    tree: Path, *, owner: str, name: str, fill: Callable[[str], None] | None = None
) -> Iterator[KeyedDeployment]:
    """``tuneq serve`` from ``tree`` with keys on, ready and idle. ``fill(database_url)`` writes
    the benchmark's rows after the migration, before the server starts. ``name``: the server
    log's name when it is kept after a failure."""
    database_url = fresh_postgres_schema()
    try:
        with tempfile.TemporaryDirectory(prefix=f"tuneq-bench-{name}-") as tmp:
            home = Path(tmp)
            env = {**tuneq_env(home=home, database_url=database_url), "TUNEQ_AUTH": "on", "PYTHONPATH": str(tree)}
            log = home / "serve.log"
            migrate(env, log, cwd=tree)
            if fill is not None:
                fill(database_url)
            key = _create_key(tree, env, owner)
            port = free_port()
            argv = [sys.executable, "-m", "cli.main", "serve", "--port", str(port)]
            with Server(argv, env=env, log=log, port=port, cwd=tree) as server:
                try:
                    server.wait_ready("/readyz")
                    server.wait_idle()
                    yield KeyedDeployment(server, key, owner, database_url, home, tree)
                except BaseException:
                    keep_log(log, name)
                    raise
    finally:
        drop_schema(database_url)


def trees_argument(parser: argparse.ArgumentParser, specs: list[str]) -> dict[str, Path]:
    """``--tree NAME=PATH`` options as {name: checkout}; none: this checkout alone."""
    if not specs:
        return {"this checkout": REPO}
    trees = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name or not path or not (Path(path) / "cli" / "main.py").is_file():
            parser.error(f"--tree {spec}: give NAME=PATH of a tuneq checkout")
        trees[name] = Path(path).resolve()
    return trees
