"""A test process that dies mid-run (killed, out of memory, a crash in native code) costs the
suite the test it died in, never the run: `make test`'s group scheduling
(tests/xdist_scheduling.py) goes on with the rest and ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Each file a group. The first finishes before the crash (xdist 3.8 re-queued it as an empty batch),
# the second dies in its first test with one left to run (xdist 3.8 ran the crash again in each
# replacement), and the last groups hold one test each (a replacement given one waited forever).
SUITE = {
    "test_first.py": """
        def test_one(): pass
        def test_two(): pass
        def test_three(): pass
    """,
    "test_dies.py": """
        import os, time
        def test_dies():
            time.sleep(1.0)  # after test_first.py has finished in the other process
            os._exit(1)
        def test_after_the_death(): pass
    """,
    "test_single_1.py": "def test_single(): pass\n",
    "test_single_2.py": "def test_single(): pass\n",
    "test_single_3.py": "import time\ndef test_single(): time.sleep(2.0)\n",
}


def run_suite(tmp_path: Path, *plugins: str, timeout: float) -> str | None:
    """pytest's output, or None when it had not ended within ``timeout`` (then killed, with its
    test processes)."""
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repository's settings
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder"]
    command += ["--disable-plugin-autoload", "-p", "xdist.plugin", "-p", "no:cacheprovider"]
    for plugin in plugins:
        command += ["-p", plugin]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return None
    return output


def test_a_dead_test_process_fails_its_test_and_the_run_goes_on_to_the_end(tmp_path: Path) -> None:
    output = run_suite(tmp_path, "tests.xdist_scheduling", timeout=120)
    assert output is not None, "the run did not end"
    assert "replacing crashed worker" in output, output
    assert "1 failed, 7 passed" in output, output
    assert "test_dies.py::test_dies" in output, output


def test_xdist_own_group_scheduling_still_hangs_there(tmp_path: Path) -> None:
    """Why tests/xdist_scheduling.py exists: once this passes (a pytest-xdist that ends the run),
    the module and its hook can go."""
    assert run_suite(tmp_path, timeout=15) is None  # ours ends in ~3 s
