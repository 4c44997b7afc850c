"""Several processes doing the same thing at the same moment, as an API and workers starting
together do, for tests of start-up races.

One Python process imports what the processes need (``setup``), then forks ``n`` children that
wait at a barrier and run ``body`` together: the race is the same as between separately started
processes, minus ``n - 1`` imports of the packages (seconds of CPU each), and tighter, since
none is still importing when the others begin.
"""

from __future__ import annotations

import subprocess
import sys

_FORK_TOGETHER = """
import os, sys, traceback
setup, body, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
exec(setup)
go_read, go_write = os.pipe()
children = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        os.read(go_read, 1)  # the barrier: returns once the parent closes its end
        try:
            exec(body)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    children.append(pid)
os.close(go_write)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print(" ".join(map(str, codes)))
sys.exit(0 if all(code == 0 for code in codes) else 1)
"""


def run_together(setup: str, body: str, *, env: dict[str, str], n: int = 4, timeout: float = 120) -> None:
    """Run ``body`` in ``n`` processes at once, after ``setup`` (imports) in their parent;
    fails the test with the children's tracebacks when any of them fails."""
    done = subprocess.run(
        [sys.executable, "-c", _FORK_TOGETHER, setup, body, str(n)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"exit codes {done.stdout.strip()}:\n{done.stderr[-3000:]}"
