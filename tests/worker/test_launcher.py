"""How a worker learns its hardware without importing torch where it need not."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from worker import launcher


def test_a_cpu_build_of_torch_is_read_without_importing_it() -> None:
    probe = (
        "import sys; from worker.launcher import detect_hardware, torch_build_has_gpu_support\n"
        "print(torch_build_has_gpu_support(), detect_hardware().accelerator, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "cpu", "False"]  # this machine's torch is the CPU wheel


@pytest.mark.parametrize(("line", "gpu"), [("cuda = '12.8'", True), ("hip = '6.4'", True), ("cuda = None", False)])
def test_a_gpu_build_means_the_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, gpu: bool) -> None:
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('torch itself must not be imported')\n")
    (package / "version.py").write_text(f"from typing import Optional\n{line}\n")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: importlib.util.spec_from_file_location(name, package / "__init__.py")
    )
    assert launcher.torch_build_has_gpu_support() is gpu
