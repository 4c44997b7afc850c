"""DeepSpeed's optimizer and CPU comm ops: built at install, loaded once by the warm start for its ranks."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.jobs.hardware import Hardware
from tests.worker.conftest import LockedOps, abandon_lock
from worker import deepspeed_ops, launcher
from worker.deepspeed_ops import OPS, AbandonedBuildLocks

PROBE = """
import json
import re
import cpuinfo
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.op_builder.builder import OpBuilder
from worker.deepspeed_ops import preload_ops
loaded = preload_ops()
import torch
DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])  # what a rank with offload_optimizer makes
print(json.dumps({
    "loaded": loaded,
    "modules": sorted(OpBuilder._loaded_ops),
    "cuda": torch.cuda.is_initialized(),
    "cpu_info_asked": cpuinfo.get_cpu_info.cache_info().misses,
}))
"""


def test_the_warm_start_preloads_every_op_for_its_forked_ranks() -> None:
    # In the ranks' environment (TORCH_EXTENSIONS_DIR: where `tuneq build-ops` put them), as the
    # zygote runs it. DeepSpeed's per-process cache of loaded ops is what a forked rank inherits.
    env = launcher.rank_environment(Hardware("cpu", 2), num_ranks=1, worker_pid=os.getpid())
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["loaded"] == list(OPS)
    assert {"cpu_adam", "fused_adam", "deepspeed_shm_comm"} <= set(probe["modules"])
    assert probe["cuda"] is False
    # py-cpuinfo (a subprocess per call) was asked once, not twice per op and once per optimizer.
    assert probe["cpu_info_asked"] == 1


def test_a_build_lock_no_process_holds_is_removed_on_the_second_look_and_a_held_one_kept(tmp_path: Path) -> None:
    abandoned = abandon_lock(tmp_path / "cpu_adam" / "lock")
    held = tmp_path / "fused_adam" / "lock"
    held.parent.mkdir()
    holder = subprocess.Popen(  # a live load: torch keeps the lock open until it removes it
        [
            sys.executable,
            "-c",
            f"import os, time; os.open({str(held)!r}, os.O_CREAT | os.O_EXCL); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline()
        locks = AbandonedBuildLocks(tmp_path)
        assert locks.scan() is True  # unheld once: it could be a holder between close and remove
        assert abandoned.exists()
        assert locks.scan() is False  # unheld twice: removed
        assert not abandoned.exists() and held.exists() and locks.removed == [abandoned]
        # Taken again since (and unheld on this look: a holder between close and remove): new.
        abandon_lock(abandoned)
        assert locks.scan() is True and abandoned.exists()
    finally:
        holder.kill()
        holder.wait()
    assert locks.scan() is True  # the holder was killed: its lock is unheld, a first time
    assert not abandoned.exists() and held.exists()
    assert locks.scan() is False and not held.exists()


def test_a_look_that_fails_leaves_the_lock_and_raises_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The looks run inside the zygote's preload and each rank's setup: a failure of theirs
    must not fail the load, only leave it as torch would have it."""
    abandoned = abandon_lock(tmp_path / "cpu_adam" / "lock")

    def unreadable() -> Iterator[tuple[int, int]]:
        raise PermissionError("/proc is not readable here")

    monkeypatch.setattr(deepspeed_ops, "_open_locks", unreadable)
    locks = AbandonedBuildLocks(tmp_path)
    assert (locks.scan(), locks.scan()) == (False, False)
    assert abandoned.exists()


def test_a_lock_left_by_a_killed_load_does_not_hold_the_next_load(ops_left_locked: LockedOps) -> None:
    """Every later load of an op waited forever on the lock a killed loader left (torch's
    FileBaton.wait); the warm start and `tuneq build-ops` now remove it (the ranks too:
    tests/worker/rank/test_recipe.py)."""
    env = launcher.rank_environment(Hardware("cpu", 2), num_ranks=1, worker_pid=os.getpid())
    env["TORCH_EXTENSIONS_DIR"] = str(ops_left_locked.directory)
    probe = "import json; from worker.deepspeed_ops import preload_ops; print(json.dumps(preload_ops()))"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == list(OPS)
    assert not any(lock.exists() for lock in ops_left_locked.locks)
    assert done.stderr.count("was killed before it released this lock") == len(OPS)


def test_the_cpus_description_is_asked_once_per_host_and_kept_beside_the_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """py-cpuinfo's answer (a subprocess, over a second of CPU, per call) is kept for the process
    and beside the ops built for this host: the next warm start or launched rank reads it, and
    never asks again."""
    import cpuinfo

    from worker.deepspeed_ops import remember_cpu_info

    described = {"arch": "X86_64", "flags": ["avx2", "fma"], "brand_raw": "a CPU"}
    asked: list[int] = []

    def ask() -> dict[str, object]:
        asked.append(1)
        return described

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))
    monkeypatch.setattr(cpuinfo, "get_cpu_info", ask)
    remember_cpu_info()
    assert cpuinfo.get_cpu_info() == cpuinfo.get_cpu_info() == described and asked == [1]
    (kept,) = (tmp_path / "ops" / "tuneq-cpuinfo").glob("*.json")
    assert json.loads(kept.read_text()) == described

    def must_not_be_asked() -> dict[str, object]:
        raise AssertionError("py-cpuinfo was asked again on the same host")

    monkeypatch.setattr(cpuinfo, "get_cpu_info", must_not_be_asked)  # as in the next process
    remember_cpu_info()
    assert cpuinfo.get_cpu_info() == described


def test_the_ranks_run_the_ninja_of_their_own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's JIT runs `ninja` from PATH, and DeepSpeed's dependency installs one beside this
    interpreter. A worker or `tuneq build-ops` started as `.venv/bin/tuneq` (no virtual
    environment on PATH) could load no op on a host without a system ninja ("Ninja is required
    to load C++ extensions"), and with a system ninja of another version rebuilt every op
    whenever the two alternated (each discards the other's build log)."""
    scripts = sysconfig.get_path("scripts")
    monkeypatch.setenv("PATH", f"/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}{scripts}")
    env = launcher.rank_environment(Hardware("cpu", 1), num_ranks=1, worker_pid=os.getpid())
    assert env["PATH"].split(os.pathsep) == [scripts, "/usr/local/bin", "/usr/bin"]
    assert shutil.which("ninja", path=env["PATH"]) == os.path.join(scripts, "ninja")


def _compile_as_torch_does(prefix: Path, env: dict[str, str]) -> dict[str, int]:
    """Compile a source under ``prefix`` the way torch's JIT builds an op (``ccache c++ -g -c``,
    absolute paths, in a build directory under the prefix); ccache's counters afterwards."""
    source = prefix / "lib" / "site-packages" / "op" / "op.cpp"
    source.parent.mkdir(parents=True)
    source.write_text("int scale(int x) { return 3 * x; }\n")
    build = prefix / "torch_extensions" / "op"
    build.mkdir(parents=True)
    flags = ["-g", "-O1", f"-I{source.parent}", "-c", str(source), "-o", "op.o"]
    subprocess.run(["ccache", "c++", *flags], cwd=build, env=env, check=True, timeout=60)
    stats = subprocess.run(["ccache", "--print-stats"], env=env, capture_output=True, text=True, check=True)
    return {name: int(count) for name, count in (line.split("\t") for line in stats.stdout.splitlines())}


def test_an_op_compiled_for_one_virtual_environment_is_a_ccache_hit_in_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh checkout's `tuneq build-ops` (its own .venv, its own paths) compiles nothing that
    another environment on the host compiled before, where ccache is installed: torch compiles
    through it, and the ranks' environment makes the prefix's paths and the build directory
    (DeepSpeed compiles with -g) drop out of the hash."""
    from tests.conftest import require_service

    if shutil.which("ccache") is None:
        require_service("ccache", "not installed (`apt-get install ccache`, as .ci/run does)")
    hits = []
    for name in ("first-checkout", "second-checkout"):
        monkeypatch.setattr(sys, "prefix", str(tmp_path / name / ".venv"))
        env = launcher.rank_environment(Hardware("cpu", 1), num_ranks=1, worker_pid=os.getpid())
        env["CCACHE_DIR"] = str(tmp_path / "ccache")  # this test's own cache and counters
        hits.append(_compile_as_torch_does(Path(sys.prefix), env)["direct_cache_hit"])
    assert hits == [0, 1]
    # Without the ranks' settings the same compile in a third environment is a miss.
    plain = {**os.environ, "CCACHE_DIR": str(tmp_path / "ccache")}
    for setting in ("CCACHE_BASEDIR", "CCACHE_NOHASHDIR"):
        plain.pop(setting, None)
    third = _compile_as_torch_does(tmp_path / "third-checkout" / ".venv", plain)
    assert third["direct_cache_hit"] == 1, "still the second checkout's one hit"


SKIPPING_PROBE = """
from deepspeed.accelerator import get_accelerator
from worker.deepspeed_ops import build_ops
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
accelerator = get_accelerator()
has = accelerator.create_op_builder
accelerator.create_op_builder = lambda name: None if name == "FusedAdamBuilder" else has(name)
print(build_ops())
"""


def test_build_ops_says_each_op_it_builds_with_its_time_and_each_it_skips() -> None:
    """`make install` ran `tuneq build-ops` for minutes without a line (three ops compiled one
    after the other, a minute or more each on 2 cores): now each op says when it starts, how
    long it took and how it was had (compiled, from ccache, already built), and an op this
    host's accelerator has not (the shared-memory all-reduce on a GPU host) is said skipped."""
    env = launcher.rank_environment(Hardware("cpu", 1), num_ranks=1, worker_pid=os.getpid())
    done = subprocess.run(
        [sys.executable, "-m", "worker.deepspeed_ops"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[0].startswith("DeepSpeed's ops for the cpu accelerator, into ")
    for name in ("cpu_adam", "fused_adam", "deepspeed_shm_comm"):
        start = re.compile(rf"{name} \(.+\): started(, not built yet|$)")
        started = next(i for i, line in enumerate(lines) if start.match(line))
        assert re.fullmatch(
            rf"{name}: done in [\d.]+ s \((already built|from ccache|compiled, 2 sources)\)", lines[started + 1]
        )
    assert lines[-1].startswith("DeepSpeed's ops ready in ") and lines[-1].endswith(
        ": cpu_adam, fused_adam, deepspeed_shm_comm"
    )
    skipping = subprocess.run(
        [sys.executable, "-c", SKIPPING_PROBE], env=env, capture_output=True, text=True, timeout=600
    )
    assert skipping.returncode == 0, skipping.stderr[-3000:]
    assert (
        "FusedAdamBuilder (fused Adam, for Adam and AdamW not offloaded): skipped, the cpu accelerator has no such op"
        in skipping.stderr
    )
    assert skipping.stdout.strip() == "['CPUAdamBuilder', 'ShareMemCommBuilder']"


class WritingBuilder:
    """An op builder whose load writes its build's objects, as torch's JIT does when it compiles."""

    name = "tiny_op"

    def __init__(self, directory: Path, *, compiles: int) -> None:
        self.directory, self.compiles = directory / self.name, compiles

    def load(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for n in range(self.compiles):
            (self.directory / f"source{n}.o").write_bytes(os.urandom(8))
        if self.compiles:
            (self.directory / f"{self.name}.so").write_bytes(os.urandom(8))


def test_an_op_build_says_whether_it_compiled_took_from_ccache_or_was_built_already(tmp_path: Path) -> None:
    from worker.deepspeed_ops import CompilerCache, OpBuild, _compiled_how

    no_ccache = CompilerCache(None)
    assert OpBuild.of(WritingBuilder(tmp_path, compiles=2), directory=tmp_path, compiler_cache=no_ccache).how == (
        "compiled, 2 sources"
    )
    assert OpBuild.of(WritingBuilder(tmp_path, compiles=0), directory=tmp_path, compiler_cache=no_ccache).how == (
        "already built"
    )
    # ccache's counters before and after the op's compiles (`ccache --print-stats`).
    before = {"direct_cache_hit": 4, "preprocessed_cache_hit": 1, "cache_miss": 7}
    assert _compiled_how(2, before, {**before, "direct_cache_hit": 6}) == "from ccache"
    assert _compiled_how(2, before, {**before, "preprocessed_cache_hit": 2, "cache_miss": 8}) == (
        "1 of 2 sources from ccache, the others compiled"
    )
    assert _compiled_how(2, before, {**before, "cache_miss": 9}) == "compiled, 2 sources"
