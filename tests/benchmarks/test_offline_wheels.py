"""What benchmarks/offline_wheels.py decides to carry to a GPU host without a package index."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from benchmarks.offline_wheels import Needed, fetch, read_host_packages, runtime_closure, to_carry


def test_the_host_list_takes_bare_names_and_pip_freeze_lines(tmp_path: Path) -> None:
    listing = tmp_path / "host.txt"
    listing.write_text("# the image\nPyYAML\ntorch==2.11.0+cu130  # CUDA\n\nhuggingface_hub>=1.0\nuvicorn[standard]\n")
    assert read_host_packages(listing) == {"pyyaml", "torch", "huggingface-hub", "uvicorn"}


def test_the_checked_in_host_list_is_the_gpu_image() -> None:
    host = read_host_packages(Path(__file__).parents[2] / "benchmarks" / "gpu_host_packages.txt")
    assert {"torch", "triton", "transformers", "numpy"} <= host
    assert not {"deepspeed", "fastapi", "celery", "sqlmodel"} & host


def test_the_closure_is_tuneqs_runtime_with_the_gpu_extra_at_the_installed_versions() -> None:
    closure = {n.name: n.version for n in runtime_closure("tuneq", {"gpu"}, python_version="3.12")}
    assert closure["deepspeed"] == metadata.version("deepspeed")
    assert closure["pydantic-core"] == metadata.version("pydantic-core")  # a requirement of a requirement
    assert closure["uvloop"] == metadata.version("uvloop")  # through uvicorn's `standard` extra
    assert "liger-kernel" in closure  # the gpu extra, installed or not
    assert "tuneq" not in closure
    assert not {"pytest", "schemathesis", "moto", "mypy"} & closure.keys()  # the dev extra is not run time


def test_what_is_carried_is_what_the_host_lacks_and_the_libraries_tuneq_reaches_into() -> None:
    needed = [
        Needed("deepspeed", "0.19.8"),
        Needed("numpy", "2.4.6"),
        Needed("transformers", "5.25.0"),
        Needed("torch", "2.13.0"),
        Needed("nvidia-nccl-cu13", "2.28.0"),
        Needed("triton", None),
        Needed("liger-kernel", None),
    ]
    carried = to_carry(needed, host={"numpy", "transformers"})
    assert [n.requirement for n in carried] == ["deepspeed==0.19.8", "transformers==5.25.0", "liger-kernel"]


def test_a_kept_wheel_is_reused_and_another_version_of_it_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two wheels of one distribution in the folder would stop the host's install."""
    calls: list[list[str]] = []

    def pip(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        (tmp_path / "hjson-3.1.0-py3-none-any.whl").write_bytes(b"wheel")  # what `pip download` writes
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip)
    kept = tmp_path / "deepspeed-0.19.8-py3-none-any.whl"
    kept.write_bytes(b"wheel")
    assert fetch(Needed("deepspeed", "0.19.8"), tmp_path, python_version="3.12") == kept
    assert calls == []

    (tmp_path / "hjson-3.0.0-py3-none-any.whl").write_bytes(b"old")
    assert fetch(Needed("hjson", "3.1.0"), tmp_path, python_version="3.12").name == "hjson-3.1.0-py3-none-any.whl"
    assert sorted(p.name for p in tmp_path.glob("hjson-*")) == ["hjson-3.1.0-py3-none-any.whl"]
    assert calls[0][-1] == "hjson==3.1.0" and "3.12" in calls[0]
