"""Wheels for a GPU host that cannot reach a package index: ``TUNEQ_WHEELS=.whl bash benchmarks/gpu.sh``.

Such a host (the device machines the GPU benchmark runs on here, or an air-gapped GPU box) has a
CUDA build of torch and much of the Hugging Face stack in its image, but not the rest of what
tuneq runs on, and ``make install`` cannot fetch it there. Run on a machine that has this
checkout installed (``make install``) and a package index::

    python -m benchmarks.offline_wheels --host-packages benchmarks/gpu_host_packages.txt \\
        --python-version 3.12 --dest .whl

It writes a wheel of every distribution that tuneq (with its ``gpu`` extra) needs at run time
and the host lacks, at the version installed here, which is the version the tests passed with,
for the host's Python on manylinux x86-64. A distribution published only as source (DeepSpeed)
is built into a wheel here, which must come out pure Python. Some libraries the host does have
are carried anyway (``ALWAYS_CARRIED``): tuneq reaches into their internals, so it must run
with the version it was tested with. torch, Triton and CUDA's libraries never are (gigabytes,
built for the host's driver). On the host, ``benchmarks/gpu.sh`` installs the wheels into a
directory on ``PYTHONPATH``, ahead of the image's own packages.
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

logger = logging.getLogger(__name__)

# Carried even where the host has them: tuneq patches or reads their internals (attention
# implementations, model loading, adapters), so an older release on the host can change the math.
ALWAYS_CARRIED = frozenset({"transformers", "peft", "accelerate", "huggingface-hub"})
# Never carried: the host's own CUDA builds (several GB, matched to its driver).
NEVER_CARRIED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|cupy-.*)$")
# The platforms pip may take a binary wheel for: manylinux x86-64, newest first.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# What one device call can take with the repository itself (64 MiB in all, about 7 MiB of checkout).
DEFAULT_MAX_MIB = 56


@dataclass(frozen=True)
class Needed:
    """A distribution tuneq needs at run time: its version where it is installed here."""

    name: str
    version: str | None  # None: not installed here (the gpu extra on a CPU machine)

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name


def read_host_packages(path: Path) -> set[str]:
    """The canonical names in a list of the host's distributions: one a line, a bare name or
    ``pip list --format=freeze``'s ``name==version``; ``#`` starts a comment."""
    names: set[str] = set()
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            names.add(canonicalize_name(re.split(r"[=<>!~ ;\[]", entry, maxsplit=1)[0]))
    return names


def runtime_closure(root: str, extras: set[str], *, python_version: str) -> list[Needed]:
    """``root`` and everything it requires at run time, with ``extras``, as installed here: the
    requirements' markers are read for the host's Python version, not this one's."""
    environment = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    found: dict[str, Needed] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    pending: list[tuple[str, set[str]]] = [(root, extras)]
    while pending:
        name, wanted_extras = pending.pop()
        key = canonicalize_name(name)
        if (key, frozenset(wanted_extras)) in seen:
            continue
        seen.add((key, frozenset(wanted_extras)))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[key] = Needed(key, None)
            continue
        found[key] = Needed(key, dist.version)
        for text in dist.requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(
                marker.evaluate({**environment, "extra": extra}) for extra in (wanted_extras or {""})
            ):
                pending.append((requirement.name, set(requirement.extras)))
    return sorted((n for n in found.values() if n.name != canonicalize_name(root)), key=lambda n: n.name)


def to_carry(needed: list[Needed], host: set[str]) -> list[Needed]:
    """What the host lacks, plus ALWAYS_CARRIED, less NEVER_CARRIED."""
    return [n for n in needed if not NEVER_CARRIED.match(n.name) and (n.name not in host or n.name in ALWAYS_CARRIED)]


def _wheel_of(name: str, dest: Path) -> Path | None:
    for wheel in dest.glob("*.whl"):
        if parse_wheel_filename(wheel.name)[0] == canonicalize_name(name):
            return wheel
    return None


def fetch(needed: Needed, dest: Path, *, python_version: str) -> Path:
    """A wheel of ``needed`` in ``dest`` for the host: downloaded as a binary for its Python and
    platform, or built here from source where only that is published (it must be pure Python)."""
    existing = _wheel_of(needed.name, dest)
    if existing is not None:
        if needed.version is None or parse_wheel_filename(existing.name)[1] == Version(needed.version):
            return existing
        existing.unlink()  # an earlier run's other version: two of one distribution stop the install
    tag = python_version.replace(".", "")
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    download += ["--python-version", python_version, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3"]
    download += ["--abi", "none", *platforms, "--platform", "any", "-d", str(dest), needed.requirement]
    if subprocess.run(download, capture_output=True, text=True).returncode != 0:
        logger.info("%s: no binary wheel for Python %s; building one here", needed.requirement, python_version)
        build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        built = subprocess.run([*build, "-w", str(dest), needed.requirement], capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"{needed.requirement}: no wheel could be downloaded or built:\n{built.stderr}")
    wheel = _wheel_of(needed.name, dest)
    if wheel is None:
        raise RuntimeError(f"{needed.requirement}: pip succeeded but left no wheel in {dest}")
    tags = parse_wheel_filename(wheel.name)[3]
    if not any((t.abi, t.platform) == ("none", "any") or t.interpreter == f"cp{tag}" or t.abi == "abi3" for t in tags):
        wheel.unlink()
        raise RuntimeError(f"{needed.requirement}: the wheel built here ({wheel.name}) is not pure Python")
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host-packages", type=Path, required=True, help="the host's distributions, one a line")
    parser.add_argument("--python-version", required=True, help="the host's Python, e.g. 3.12")
    parser.add_argument("--dest", type=Path, default=Path(".whl"), help="its other wheels are removed")
    parser.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB, help="fail if the wheels add up to more")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: give the host's major.minor, e.g. 3.12")
    carry = to_carry(
        runtime_closure("tuneq", {"gpu"}, python_version=args.python_version), read_host_packages(args.host_packages)
    )
    args.dest.mkdir(parents=True, exist_ok=True)
    wheels = [fetch(n, args.dest, python_version=args.python_version) for n in carry]
    kept = {w.name for w in wheels}
    for stale in args.dest.glob("*.whl"):  # an earlier run's wheels of what is no longer carried
        if stale.name not in kept:
            stale.unlink()
    total = sum(w.stat().st_size for w in wheels) / 2**20
    logger.info("%d wheels, %.1f MiB, in %s: %s", len(wheels), total, args.dest, " ".join(n.requirement for n in carry))
    if total > args.max_mib:
        logger.error("%.1f MiB is over --max-mib %.0f", total, args.max_mib)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
