"""``--dist loadgroup`` that survives a test process dying mid-run.

pytest-xdist 3.8's group scheduler deadlocks after it replaces a crashed test process
(pytest-dev/pytest-xdist#1323, #1327, #1378; the first two fixed after 3.8, the third open):

- the dead process's whole workload goes back on the queue, its finished groups included, and
  a finished group later goes out as an empty batch that never completes, so the process given
  it is never given more;
- a replacement given one group of one test waits for a second test that never comes (a test
  process runs an item only once it knows the next one, or that there is none);
- the test it died in is still pending, so its replacement runs it again, and dies again.

The suite then waits, every process idle, until CI's clock runs out, as it did once when one
test process was killed. Here the dead process's unfinished groups alone go back, the test it
died in (already reported failed) stays done, and a process is kept at two tests or more, or
told there are no more. The hook below hands it to xdist: tests/conftest.py imports it.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import WorkerController

# As xdist's scheduler: a process with this many tests or fewer left is given the next group.
REFILL_AT_PENDING = 2


class CrashSafeLoadGroupScheduling(LoadGroupScheduling):
    def remove_node(self, node: WorkerController) -> str | None:
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        crashed_scope, crashitem = next(
            (scope, nodeid) for scope, unit in unfinished.items() for nodeid, done in unit.items() if not done
        )
        unfinished[crashed_scope][crashitem] = True  # reported failed by xdist; not run again
        for scope, unit in unfinished.items():
            if not all(unit.values()):
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)  # before what nobody has started
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= REFILL_AT_PENDING:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> CrashSafeLoadGroupScheduling | None:
    if config.getvalue("dist") == "loadgroup":
        return CrashSafeLoadGroupScheduling(config, log)
    return None  # xdist's own
