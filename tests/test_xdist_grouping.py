"""`make test` runs two test processes (pytest-xdist, ``--dist loadgroup``) and relies on the
``xdist_group`` marks tests/conftest.py gives each file: a module's shared service is started
once, in one process. pytest 9.2 broke that silently (pytest-dev/pytest-xdist#1386): every test
still passed, each process just started its own services. This fails if the grouping stops."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

GROUPED = """
import pytest

pytestmark = pytest.mark.xdist_group("one-process")


@pytest.mark.parametrize("n", range(6))
def test_grouped(n):
    pass
"""


def test_a_groups_tests_run_in_one_test_process(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    processes = re.findall(r"\[(gw\d)\] .*PASSED", done.stdout)
    assert len(processes) == 6 and len(set(processes)) == 1, done.stdout[-2000:]
