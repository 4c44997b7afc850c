"""A pytest plugin that records what each test costs in CPU, for the suite-time work (issue 21).

``pytest -p tests.cpu_profile`` with ``TUNEQ_TEST_CPU_PROFILE=<file>`` appends one JSON line per
test: its wall time, the test process's own CPU, and the CPU of the child processes it reaped
(the `tuneq` services and workers a test or its fixtures start, with their ranks). A module
fixture's service is reaped at the module's last test, so sum by file to compare files.
On a CPU-bound machine the CPU seconds, not the wall time, are what running tests side by side
cannot hide.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Generator

import pytest


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    path = os.environ.get("TUNEQ_TEST_CPU_PROFILE")
    if not path:
        yield
        return
    wall, own, children = time.monotonic(), _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN)
    yield
    record = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - wall, 3),
        "own_cpu_s": round(_cpu_seconds(resource.RUSAGE_SELF) - own, 3),
        "children_cpu_s": round(_cpu_seconds(resource.RUSAGE_CHILDREN) - children, 3),
        "process": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
