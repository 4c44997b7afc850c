from __future__ import annotations

import pytest

from worker import launcher


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built() -> None:
    # `make install` compiles DeepSpeed's CPU Adam op (`tuneq build-ops`); this is the same
    # call, a few seconds when it is built, so a job's first step never includes a compile.
    launcher.build_ops(launcher.detect_hardware())
