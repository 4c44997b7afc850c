"""Ranks forked from a warm process, instead of started cold by DeepSpeed's launcher.

A cold ``deepspeed`` launch spends most of the time before its first step importing torch,
DeepSpeed and transformers: in the launcher's runner, again in ``launch.py``, again in every
rank (about 10 s each on a small host). The warm start pays that once per worker process:
``python -m worker.rank.warm_start`` (the *zygote*) imports them (``PRELOAD``) and loads DeepSpeed's
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

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import IO, Any

import setproctitle

from worker.deepspeed_ops import preload_ops
from worker.rank.train import process_running
from worker.shm_buffers import remove_job_buffers

logger = logging.getLogger(__name__)

# What the zygote imports once: everything a rank imports before its first step. The model
# class of a given architecture (e.g. modeling_gpt_neo) is still imported per job.
PRELOAD = (
    "torch",
    "deepspeed",
    "transformers",
    "transformers.modeling_utils",
    "transformers.integrations.deepspeed",
    "peft",
    "worker.rank.train",
    "worker.rank.checkpointing",
    "worker.rank.batches",
    "worker.rank.model_loading",
    "shared.data.prepared",
)
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
            [sys.executable, "-m", "worker.rank.warm_start"],
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

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()  # the zygote exits at end of input
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()

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
                    logger.info(
                        "warm start ready in %.1fs (%s imported)",
                        time.monotonic() - self._started_at,
                        ", ".join(PRELOAD[:3]),
                    )
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


_current: WarmStart | None = None


def warm_up(env: Mapping[str, str]) -> None:
    """Start this worker process's zygote with the environment its ranks will have (what
    torch, DeepSpeed and the Hugging Face libraries read at import time must match)."""
    global _current
    _current = WarmStart(env)


def wait_until_ready(*, keep_alive: Callable[[], None], timeout: float = READY_TIMEOUT_SECONDS) -> None:
    """Wait for this worker's zygote to finish importing (it usually has: it imports while the
    worker is idle), calling ``keep_alive`` every second, so that a job claimed just after the
    worker started keeps its lease meanwhile. Returns at the timeout regardless: a zygote not
    up by then means DeepSpeed's launcher."""
    zygote = _current
    deadline = time.monotonic() + timeout
    while zygote is not None and time.monotonic() < deadline and not zygote.settled(timeout=1.0):
        keep_alive()


def warm_ranks() -> WarmStart | None:
    """The zygote, if ranks can be forked from it now; None otherwise (a zygote that died or
    never came up is replaced for the next job)."""
    global _current
    if _current is None:
        return None
    if _current.usable():
        return _current
    if not _current.alive:
        _current = WarmStart(_current.env)
    return None


# The zygote: ``python -m worker.rank.warm_start``.


def serve() -> None:
    """Import PRELOAD, say so, then fork a rank per request until the worker closes stdin."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the imports (and anything else) print goes to the log, not the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the worker, which decides
    for module in PRELOAD:
        __import__(module)
    import torch

    preload_ops()

    protocol.write(json.dumps({"ready": True, "cuda_initialised": torch.cuda.is_initialized()}) + "\n")
    ranks: dict[int, RankStart] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.2)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the worker is gone; its ranks stop themselves (worker.rank.train.watch_worker)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                start = RankStart(**json.loads(line))
                pid = os.fork()
                if pid == 0:
                    _become_rank(start, protocol)
                ranks[pid] = start
                protocol.write(json.dumps({"started": pid}) + "\n")
        _reap(ranks, protocol)


def _reap(ranks: dict[int, RankStart], protocol: IO[str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        if (start := ranks.pop(pid, None)) is not None:
            # The job log's last word on the rank, as DeepSpeed's launch.py writes one.
            with contextlib.suppress(OSError), open(start.log_path, "a", encoding="utf-8") as log:
                log.write(f"tuneq warm start: rank {start.local_rank} (pid {pid}) exited with status {code}\n")
        protocol.write(json.dumps({"exited": pid, "code": code}) + "\n")


def _become_rank(start: RankStart, protocol: IO[str]) -> None:
    """In the forked child: become what DeepSpeed's launcher would have started, then exit."""
    code = 1
    try:
        os.close(protocol.fileno())  # not .close(): that would flush the zygote's buffer twice
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()  # its own group, as the launcher's ranks are, so stop() reaches its children
        setproctitle.setproctitle(start.title)  # `ps` shows which job's rank this is
        log = os.open(start.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.chdir(start.cwd)
        os.environ.clear()
        os.environ.update(start.env)
        import torch

        # OMP_NUM_THREADS was read when the zygote imported torch; this job's share may differ.
        if threads := start.env.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(threads))
        from worker.rank.train import main

        main(["--spec", start.spec_path, f"--local_rank={start.local_rank}"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # what a normal interpreter exit would run
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve()
