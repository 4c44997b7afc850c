"""How a worker learns its hardware without importing torch where it need not."""

from __future__ import annotations

import importlib.util
import json
import os
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


def test_the_gpu_probes_answer_gives_the_smallest_devices_memory_and_bf16() -> None:
    # The child's last line is its JSON (torch may log before it).
    answer = json.dumps({"n": 4, "memory": 34_089_730_048, "bf16": False})
    hardware = launcher.gpu_hardware(f"a warning from torch\n{answer}\n")
    assert hardware is not None
    assert (hardware.accelerator, hardware.device_count) == ("cuda", 4)
    assert (hardware.device_memory_bytes, hardware.bf16_supported) == (34_089_730_048, False)
    assert launcher.gpu_hardware(json.dumps({"n": 0, "memory": None, "bf16": True})) is None


def test_the_gpu_probe_run_by_this_torch_sees_no_gpu() -> None:
    """The probe's own code, run as detect_hardware runs it: this machine's torch is the CPU
    wheel, so it reports no device (the device check runs it where there are GPUs)."""
    done = subprocess.run([sys.executable, "-c", launcher.GPU_PROBE], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"n": 0, "memory": None, "bf16": True}
    assert launcher.gpu_hardware(done.stdout) is None


def test_a_cpu_worker_records_its_host_memory_and_bf16() -> None:
    hardware = launcher.detect_hardware()  # the CPU path on this machine, no torch imported
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert hardware.accelerator == "cpu" and hardware.bf16_supported is True
    assert hardware.device_memory_bytes is not None and 0 < hardware.device_memory_bytes <= physical


def test_a_cgroup_limit_below_the_hosts_memory_is_the_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unlimited, limited = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    unlimited.write_text("max\n")
    limited.write_text(f"{2**30}\n")
    monkeypatch.setattr(launcher, "_CGROUP_MEMORY_LIMITS", (unlimited,))
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert launcher.host_memory_bytes() == physical
    monkeypatch.setattr(launcher, "_CGROUP_MEMORY_LIMITS", (unlimited, limited))
    assert launcher.host_memory_bytes() == min(physical, 2**30)


def test_the_ranks_compile_caches_are_in_the_workers_cache_directory(
    tuneq_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.settings import Settings

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/srv/triton")  # an operator's own choice stands
    env = launcher.settings_environment(Settings())
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tuneq_home / "cache" / "compile" / "inductor")
    assert "TRITON_CACHE_DIR" not in env
