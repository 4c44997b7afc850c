"""Ranks forked from a warm process, instead of started cold by DeepSpeed's launcher.

A cold ``deepspeed`` launch spends most of the time before its first step importing torch,
DeepSpeed and transformers: in the launcher's runner, again in ``launch.py``, again in every
rank (about 10 s each on a small host). The warm start pays that once per worker process:
``python -m worker.rank.zygote`` (the *zygote*) imports them (its ``PRELOAD``) and loads DeepSpeed's
optimizer ops (``deepspeed_ops.preload_ops``: seconds a rank, even when built) while the worker
is idle, and each job's ranks are ``fork()``-ed from it. A rank gets the environment DeepSpeed's
``launch.py`` gives its ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ...) and runs ``worker.rank.train.main`` exactly as it would under
the launcher: the same DeepSpeed engine, process group and checkpoints.

The zygote is single-threaded (forking a threaded process can copy a held lock into the
child) and talks to its worker over its stdin/stdout, one JSON object per line: the worker
sends ``RankStart``s, the zygote answers ``{"started": pid}`` and, when a rank exits,
``{"exited": pid, "code": n}`` (it is the ranks' parent, so only it can reap them).

A forked child cannot use CUDA if its parent initialised it, so the zygote imports with
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (``torch.cuda.is_available()`` then asks NVML and leaves
CUDA alone) and reports whether CUDA was initialised anyway; if it was, or the zygote does
not come up, the worker logs why and uses DeepSpeed's launcher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from worker.process_table import process_running
from worker.shm_buffers import remove_job_buffers

logger = logging.getLogger(__name__)

ZYGOTE_MODULE = "worker.rank.zygote"
READY_TIMEOUT_SECONDS = 300.0  # the first import of torch on a cold disk can take minutes
START_TIMEOUT_SECONDS = 60.0
FAILED_RANK_GRACE_SECONDS = 5.0
KILLED_REAP_SECONDS = 30.0
LOST_EXIT_STATUS = 1  # a rank whose exit the zygote could not report (the zygote died)


@dataclass(frozen=True)
class RankStart:
    """What one forked rank needs: its whole environment, where to log and what to run."""

    env: dict[str, str]
    spec_path: str
    log_path: str
    cwd: str
    local_rank: int
    title: str


class WarmStart:
    """The worker's side of one zygote: start it, wait for its imports, fork ranks from it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._changed = threading.Condition()
        self._ready: dict[str, Any] | None = None
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._gone = False
        self._process = subprocess.Popen(
            [sys.executable, "-m", ZYGOTE_MODULE],
            env={**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # stderr: the worker's own log, for what the imports print
        )
        self._started_at = time.monotonic()
        threading.Thread(target=self._read, name="warm-start-reader", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._gone

    def settled(self, *, timeout: float) -> bool:
        """Whether the zygote has finished importing (or exited), waiting up to ``timeout``."""
        with self._changed:
            return self._changed.wait_for(lambda: self._ready is not None or self._gone, timeout)

    def usable(self, *, timeout: float = 0) -> bool:
        """Whether ranks can be forked now (waiting up to ``timeout`` for the imports)."""
        with self._changed:
            self._changed.wait_for(lambda: self._ready is not None or self._gone, timeout)
            ready = self._ready
        if ready is None:
            logger.warning("the warm start is not up (%s); using DeepSpeed's launcher", self._why_not())
            return False
        if ready["cuda_initialised"]:
            logger.warning("CUDA was initialised in the warm start's process; using DeepSpeed's launcher")
            return False
        return not self._gone

    def fork(self, starts: list[RankStart], *, master_port: int) -> ForkedRanks:
        """Fork one rank per ``RankStart``; ``master_port`` is the one in their environment."""
        ranks = ForkedRanks(self, master_port=master_port)
        try:
            for start in starts:
                ranks.pids.append(self._fork_one(start))
        except BaseException:
            ranks.stop(grace_seconds=0)
            raise
        return ranks

    def exit_code(self, pid: int) -> int | None:
        """A forked rank's exit status (negative: killed by that signal), None while it runs."""
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
        if self._gone and not process_running(pid):
            return LOST_EXIT_STATUS
        return None

    def close(self) -> int:
        """End the zygote; its exit status (0 when it exited by itself at the end of its input,
        negative when it had to be killed)."""
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()  # the zygote exits at end of input
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)
        if self._process.poll() is None:
            self._process.kill()
        return self._process.wait()

    def _fork_one(self, start: RankStart) -> int:
        stdin = self._process.stdin
        assert stdin is not None
        with self._changed:
            before = len(self._started)
            stdin.write(json.dumps(asdict(start)).encode() + b"\n")
            stdin.flush()
            if not self._changed.wait_for(lambda: len(self._started) > before or self._gone, START_TIMEOUT_SECONDS):
                raise RuntimeError(f"the warm start did not fork {start.title} within {START_TIMEOUT_SECONDS:.0f}s")
            if len(self._started) == before:
                raise RuntimeError(f"the warm start exited before forking {start.title} ({self._why_not()})")
            return self._started[before]

    def _read(self) -> None:
        stdout = self._process.stdout
        assert stdout is not None
        for line in stdout:
            message = json.loads(line)
            with self._changed:
                if "ready" in message:
                    self._ready = message
                    logger.info("warm start ready in %.1fs", time.monotonic() - self._started_at)
                elif "started" in message:
                    self._started.append(int(message["started"]))
                elif "exited" in message:
                    self._exits[int(message["exited"])] = int(message["code"])
                self._changed.notify_all()
        self._process.wait()
        with self._changed:
            self._gone = True
            self._changed.notify_all()
        logger.warning("the warm start exited (%s)", self._why_not())

    def _why_not(self) -> str:
        code = self._process.poll()
        return "still importing" if code is None else f"its process exited with status {code}"


class ForkedRanks:
    """A job's forked ranks, behaving like the launcher process they replace: ``poll`` gives
    None while they run, 0 once all exited cleanly, and the first failure's exit status after
    stopping the rest (as DeepSpeed's ``launch.py`` does when a rank dies)."""

    def __init__(self, warm: WarmStart, *, master_port: int) -> None:
        self.warm = warm
        self.master_port = master_port
        self.killed_pids: frozenset[int] = frozenset()
        self.pids: list[int] = []
        self._returncode: int | None = None

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def poll(self) -> int | None:
        if self._returncode is None:
            codes = [self.warm.exit_code(pid) for pid in self.pids]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                # The first failure is the job's: stopping the others gives them -15 too.
                self._returncode = failed[0]
                self.stop(grace_seconds=FAILED_RANK_GRACE_SECONDS)
            elif all(c == 0 for c in codes):
                self._returncode = 0
                remove_job_buffers(self.master_port)
        return self._returncode

    def stop(self, *, grace_seconds: float) -> None:
        """SIGTERM every rank's group, wait up to the grace, then SIGKILL what is left."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and self._running():
            time.sleep(0.2)
        self.killed_pids |= {pid for pid in self.pids if self.warm.exit_code(pid) is None}
        self._signal(signal.SIGKILL)
        deadline = time.monotonic() + KILLED_REAP_SECONDS
        while time.monotonic() < deadline and self._running():
            time.sleep(0.05)
        codes = [self.warm.exit_code(pid) for pid in self.pids]
        if self._returncode is None:
            failed = [c for c in codes if c not in (None, 0)]
            self._returncode = failed[0] if failed else 0
        remove_job_buffers(self.master_port)

    def _running(self) -> bool:
        return any(self.warm.exit_code(pid) is None for pid in self.pids)

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.pids:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:  # forked a moment ago, not yet its own group leader
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
