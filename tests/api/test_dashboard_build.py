"""The dashboard's committed files are what its sources build to.

``api/dashboard/static/`` is built from ``dashboard/`` (``npm ci && npm run build``) and
committed, so that neither the service nor ``pip install`` needs Node. This rebuilds it from a
clean copy of the sources, with the versions package-lock.json pins, type-checks the sources, and
compares: a source change committed without its build fails here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require_service

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "dashboard"
BUILT = ROOT / "api" / "dashboard" / "static"


def _npm(args: list[str], cwd: Path) -> None:
    result = subprocess.run(["npm", *args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"npm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


def test_the_committed_dashboard_is_the_build_of_its_sources(tmp_path: Path) -> None:
    if shutil.which("npm") is None or shutil.which("node") is None:
        require_service("Node.js", "node and npm not found (apt-get install nodejs npm)")
    sources = tmp_path / "dashboard"
    shutil.copytree(SOURCES, sources, ignore=shutil.ignore_patterns("node_modules"))
    _npm(["ci", "--no-audit", "--no-fund", "--loglevel=error"], sources)
    _npm(["run", "check"], sources)  # tsc: the sources type-check
    out = tmp_path / "built"
    _npm(["run", "build", "--", "--outdir", str(out)], sources)

    built = {p.name: p.read_bytes() for p in out.iterdir()}
    committed = {p.name: p.read_bytes() for p in BUILT.iterdir()}
    assert sorted(built) == sorted(committed), "rebuild with `cd dashboard && npm ci && npm run build`"
    stale = [name for name in built if built[name] != committed[name]]
    assert not stale, f"{stale} differ from their build: `cd dashboard && npm ci && npm run build`, then commit them"
