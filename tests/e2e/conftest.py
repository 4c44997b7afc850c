from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# DeepSpeed compiles its CPU Adam op on first use (a minute or two, then cached in
# ~/.cache/torch_extensions). Building it once up front keeps that out of every job's timing.
BUILD_OPS = """
from deepspeed.accelerator import get_accelerator
for name in ("CPUAdamBuilder", "FusedAdamBuilder"):  # offloaded and on-device Adam
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible():
        builder.load()
"""


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built() -> None:
    # One build directory per virtual environment (inherited by every process the tests
    # start): clones with other include paths would rebuild the shared one in turn, and a
    # build killed half-way leaves a lock that makes the next one wait forever.
    os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    subprocess.run(
        [sys.executable, "-c", BUILD_OPS],
        check=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=900,
    )
