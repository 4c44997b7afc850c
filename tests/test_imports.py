"""Which code may load torch is a folder boundary: only ``worker/rank/`` (the training processes).

The API must start fast and small, the worker's main and pool processes stay light until a job
forks its ranks, and ``tuneq submit`` does not wait seconds for torch: ``api``, ``shared``,
``cli`` and the rest of ``worker`` import none of the heavy libraries at module level.
"""

from __future__ import annotations

import os
import subprocess
import sys

HEAVY = ("torch", "deepspeed", "transformers")


def test_only_worker_rank_imports_heavy_libraries() -> None:
    probe = (
        "import sys, pkgutil, importlib, api, shared, cli, worker\n"
        "for package in (api, shared, cli, worker):\n"
        "    for mod in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        if not mod.name.startswith('worker.rank'):\n"
        "            importlib.import_module(mod.name)\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported at module level: {out.stdout.strip()}"


def test_no_package_reaches_another_through_importlib() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    offenders = [
        str(path.relative_to(root))
        for package in ("api", "shared", "cli", "worker")
        for path in (root / package).rglob("*.py")
        if any(f'import_module("{p}' in path.read_text() for p in ("api", "shared", "cli", "worker"))
    ]
    assert offenders == []


def test_the_ranks_and_the_client_commands_do_not_load_the_database_layer() -> None:
    """A job's status and error class live in ``shared.jobs.status``, its measures in
    ``shared.jobs.events``: naming them loads no SQLAlchemy. The training processes never
    touch the database, and ``tuneq jobs`` / ``tuneq --help`` start in half the time without it."""
    probe = (
        "import sys\n"
        "import cli.main\n"
        "client = [m for m in ('sqlalchemy', 'sqlmodel') if m in sys.modules]\n"
        "import worker.rank.train\n"
        "rank = [m for m in ('sqlalchemy', 'sqlmodel') if m in sys.modules]\n"
        "print(client, rank)\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == "[] []"
