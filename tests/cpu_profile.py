"""A pytest plugin that records what each test costs in CPU, for the suite-time work (issue 21).

``pytest -p tests.cpu_profile`` with ``TUNEQ_TEST_CPU_PROFILE=<file>`` appends one JSON line per
test: its wall time, the test process's own CPU, and the CPU of everything the test started
(the `tuneq` services and workers it or its fixtures start, their ranks, the CLI processes).

Child processes' CPU is measured with a cgroup v1 ``cpuacct`` group per test, where the machine
lets this process make one (root, as on the dev box): the test process moves into the group as
the test starts, so every process it forks is counted there, including the ones that outlive
their parent (which ``getrusage(RUSAGE_CHILDREN)`` misses: a `tuneq dev` stopped as a whole
process group does not wait for its children). A module fixture's service is counted in the
test that started it, until it stops. Without cgroups, ``children_cpu_s`` is the CPU of the
children the test process reaped. On a CPU-bound machine the CPU seconds, not the wall time,
are what running tests side by side cannot hide.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Generator
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class CpuProfile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.records: list[tuple[dict[str, object], Path | None]] = []
        self.groups: Path | None = CPUACCT / f"tuneq-tests-{os.getpid()}"
        try:
            self.groups.mkdir()
        except OSError:
            self.groups = None

    def enter(self, index: int) -> Path | None:
        if self.groups is None:
            return None
        group = self.groups / str(index)
        group.mkdir()
        (group / "cgroup.procs").write_text(str(os.getpid()))
        return group

    def finish(self) -> None:
        """Once every test (and every service) has ended: each test's group's total, written out."""
        if self.groups is not None:
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        with open(self.path, "a") as f:
            for record, group in self.records:
                if group is not None:
                    record["children_cpu_s"] = round(
                        int((group / "cpuacct.usage").read_text()) / 1e9 - float(str(record["own_cpu_s"])), 3
                    )
                    record["measured_by"] = "cgroup"
                f.write(json.dumps(record) + "\n")
        if self.groups is not None:
            # A group a process the test left running is still in stays.
            for group in [g for _, g in self.records if g is not None] + [self.groups]:
                with contextlib.suppress(OSError):
                    group.rmdir()


_profile: CpuProfile | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _profile
    if path := os.environ.get("TUNEQ_TEST_CPU_PROFILE"):
        _profile = CpuProfile(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _profile is not None:
        _profile.finish()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if _profile is None:
        yield
        return
    group = _profile.enter(len(_profile.records))
    wall, own, children = time.monotonic(), _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN)
    yield
    record: dict[str, object] = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - wall, 3),
        "own_cpu_s": round(_cpu_seconds(resource.RUSAGE_SELF) - own, 3),
        "children_cpu_s": round(_cpu_seconds(resource.RUSAGE_CHILDREN) - children, 3),
        "process": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    _profile.records.append((record, group))
