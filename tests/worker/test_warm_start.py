"""The warm start's zygote for real: it imports, forks ranks that run worker.rank.train, reports
their exit, and a launcher whose zygote cannot come up uses DeepSpeed's launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.jobs.hardware import Hardware
from shared.settings import Settings
from worker import launcher, warm_start
from worker.launcher import Launcher, LauncherRanks

CPU = Hardware("cpu", 2)


@pytest.fixture(scope="module")
def zygote() -> Iterator[warm_start.WarmStart]:
    env = launcher.rank_environment(CPU, num_ranks=1, worker_pid=os.getpid())
    zygote = warm_start.WarmStart(env)
    assert zygote.usable(timeout=300)
    yield zygote
    assert zygote.close() == 0  # it exits by itself at the end of its input, at once (rank.zygote.exit_at_once)


def start(tmp_path: Path, *, rank: int, spec: Path) -> warm_start.RankStart:
    env = launcher.rank_environment(CPU, num_ranks=2, worker_pid=os.getpid())
    return warm_start.RankStart(
        env=launcher.launch_environment(
            env, local_rank=rank, num_ranks=2, placement=launcher.NodePlacement(), master_port=29999
        ),
        spec_path=str(spec),
        log_path=str(tmp_path / "train.log"),
        cwd=str(tmp_path),
        local_rank=rank,
        title=f"tuneq rank {rank}/2 --spec {spec}",
    )


def test_forked_ranks_run_train_and_their_failure_is_the_jobs(zygote: warm_start.WarmStart, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"  # missing: worker.rank.train fails on it at once, on every rank
    ranks = zygote.fork([start(tmp_path, rank=0, spec=spec), start(tmp_path, rank=1, spec=spec)], master_port=29999)
    assert len(set(ranks.pids)) == 2
    while ranks.poll() is None:
        pass
    assert ranks.returncode == 1
    log = (tmp_path / "train.log").read_text()
    assert "FileNotFoundError" in log and str(spec) in log  # the rank's own traceback, in the job log
    for rank, pid in enumerate(ranks.pids):
        assert f"rank {rank} (pid {pid}) exited with status 1" in log


def test_the_first_failure_is_the_jobs_not_the_stop_of_the_others(zygote: warm_start.WarmStart, tmp_path: Path) -> None:
    """Rank 1 fails while rank 0 still runs: stopping rank 0 gives it -15, which used to be
    reported (the lower pid's status) instead of rank 1's own failure."""
    fifo = tmp_path / "blocked.json"
    os.mkfifo(fifo)  # rank 0 blocks reading it
    ranks = zygote.fork(
        [start(tmp_path, rank=0, spec=fifo), start(tmp_path, rank=1, spec=tmp_path / "missing.json")], master_port=29999
    )
    while ranks.poll() is None:
        pass
    assert ranks.returncode == 1
    assert zygote.exit_code(ranks.pids[0]) == -15  # stopped after rank 1 failed
    assert ranks.killed_pids == frozenset()  # it stopped on SIGTERM: tuneq sent no SIGKILL


def test_stop_kills_a_rank_that_ignores_sigterm(zygote: warm_start.WarmStart, tmp_path: Path) -> None:
    # A rank stuck before its SIGTERM handler matters: stop() must still end it within the grace.
    fifo = tmp_path / "spec.json"
    os.mkfifo(fifo)  # reading the spec blocks until a writer comes, which never does
    ranks = zygote.fork([start(tmp_path, rank=0, spec=fifo)], master_port=29999)
    ranks.stop(grace_seconds=0.5)
    assert ranks.returncode is not None and ranks.returncode < 0  # killed by a signal
    assert (ranks.returncode == -9) == (ranks.killed_pids == frozenset(ranks.pids))  # tuneq's SIGKILL is known
    assert zygote.exit_code(ranks.pids[0]) == ranks.returncode


def test_a_zygote_that_cannot_start_means_deepspeeds_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = sys.executable
    monkeypatch.setattr(sys, "executable", "/bin/false")
    ranks_launcher = Launcher(hardware=CPU, settings=Settings(launcher="warm"))
    dead = ranks_launcher._warm
    ranks_launcher.wait_until_warm(keep_alive=lambda: None)  # as the runner does before launching
    monkeypatch.setattr(sys, "executable", python)
    (tmp_path / "spec.json").write_text("{}")
    ranks = ranks_launcher.launch_ranks(
        spec_path=tmp_path / "spec.json", num_ranks=1, log_path=tmp_path / "train.log", cwd=tmp_path
    )
    try:
        assert isinstance(ranks, LauncherRanks)
    finally:
        ranks.stop(grace_seconds=0)
    replacement = ranks_launcher._warm  # the dead zygote was replaced, for the next job
    assert replacement is not None and replacement is not dead
    try:
        assert replacement.usable(timeout=300)
    finally:
        ranks_launcher.close()


PRELOAD_PROBE = """
import json, sys
from worker.rank.zygote import preload_modules
modules = preload_modules()
import torch
print(json.dumps({"asked": modules, "missing": [m for m in modules if m not in sys.modules],
                  "cuda": torch.cuda.is_initialized()}))
"""


def test_the_zygote_imports_what_deepspeeds_engine_imports_late_on_a_cpu_host() -> None:
    """DeepSpeed imports its Muon optimizer (and with it torch's inductor, ~2 s of CPU) inside
    every engine's optimizer check: on the CPU accelerator the zygote has, for its ranks."""
    env = launcher.rank_environment(CPU, num_ranks=1, worker_pid=os.getpid())
    done = subprocess.run([sys.executable, "-c", PRELOAD_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert "deepspeed.runtime.zero.muon.muon_optimizer" in probe["asked"]
    assert probe["missing"] == [] and probe["cuda"] is False
