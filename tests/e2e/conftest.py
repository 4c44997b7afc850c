from __future__ import annotations

import os
import subprocess
import sys

import pytest

# DeepSpeed compiles its CPU Adam op on first use (a minute or two, then cached in
# ~/.cache/torch_extensions). Building it once up front keeps that out of every job's timing.
BUILD_OPS = """
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])
"""


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built() -> None:
    subprocess.run(
        [sys.executable, "-c", BUILD_OPS],
        check=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=900,
    )
