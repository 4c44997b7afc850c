"""What `make install` and `make demo` print: one line a step, not the Makefile's commands and
comments (Make echoed the comments inside recipes, which read like output)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def stub_venv(tmp_path: Path) -> Path:
    """A virtual environment whose python, uv and tuneq do nothing: the Makefile's own output."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "uv", "tuneq"):
        stub = venv / "bin" / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return venv


def make(venv: Path, *args: str) -> list[str]:
    done = subprocess.run(
        ["make", "--no-print-directory", "-B", *args, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.splitlines()


def test_make_install_prints_a_line_a_step_and_no_commands_or_comments(stub_venv: Path) -> None:
    assert make(stub_venv, "install") == [
        f"install: the virtual environment {stub_venv} (pip, setuptools, wheel)",
        "install: torch==2.13.0 (pip)",
        "install: DeepSpeed, transformers and tuneq with the extras dev (uv)",
        "install: DeepSpeed's ops (tuneq build-ops)",
        f"install: done; the commands are in {stub_venv}/bin (tuneq: {stub_venv}/bin/tuneq)",
    ]
    assert not any(line.startswith("install: DeepSpeed's ops") for line in make(stub_venv, "install", "BUILD_OPS=no"))
    assert all(line.startswith("install: ") for line in make(stub_venv, "demo"))


def test_make_v_1_shows_the_commands_too(stub_venv: Path) -> None:
    lines = make(stub_venv, "install", "V=1")
    assert f"{stub_venv}/bin/tuneq build-ops" in lines
    assert not any(line.lstrip().startswith("#") for line in lines)
