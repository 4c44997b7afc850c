"""Starting and stopping a job's ranks, one process per device: forked from the warm start, or
through DeepSpeed's own launcher.

A pool process makes one ``Launcher`` when it starts (``worker.tasks``) and hands it to the
runner for every job it runs; the launcher owns that process's warm start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from shared.jobs.hardware import Hardware
from shared.ports import free_port
from shared.settings import Settings
from worker.shm_buffers import remove_job_buffers
from worker.warm_start import READY_TIMEOUT_SECONDS, RankStart, WarmStart

logger = logging.getLogger(__name__)

TRAIN_MODULE = "worker.rank.train"
# Where DeepSpeed's JIT-compiled ops go (worker.deepspeed_ops): one directory per virtual
# environment, as a clone with other include paths would rebuild a shared one in turn.
OPS_BUILD_DIR = Path(sys.prefix) / "torch_extensions"


def detect_hardware() -> Hardware:
    """Ask torch in a short-lived child, so the worker process itself never initialises CUDA
    (a CUDA context does not survive Celery's fork) and stays free of torch's memory. A torch
    built for CPUs only cannot see a GPU, and saying so needs no import of it (seconds)."""
    if torch_build_has_gpu_support():
        probe = (
            "import json, torch; print(json.dumps({'cuda': torch.cuda.is_available(), 'n': torch.cuda.device_count()}))"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
        facts = json.loads(out.stdout.strip().splitlines()[-1])
        if facts["cuda"] and facts["n"] > 0:
            return Hardware("cuda", int(facts["n"]))
    return Hardware("cpu", os.cpu_count() or 1)


def torch_build_has_gpu_support() -> bool:
    """Whether the installed torch was built for a GPU (CUDA, ROCm or XPU), read from its
    ``torch/version.py`` alone: importing ``torch.version`` would import all of torch."""
    found = importlib.util.find_spec("torch")
    if found is None or found.origin is None:
        return True  # no torch to read: let the probe say what is wrong
    location = Path(found.origin).with_name("version.py")
    spec = importlib.util.spec_from_file_location("tuneq_torch_build", location)
    if spec is None or spec.loader is None:
        return True
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return any(getattr(build, name, None) for name in ("cuda", "hip", "xpu"))


def settings_environment(settings: Settings) -> dict[str, str]:
    """What the ranks get from tuneq's settings, beyond the worker's own environment."""
    return {"HF_ENDPOINT": settings.hf_endpoint}  # hub models come from where hf:// datasets do


def build_ops(hardware: Hardware) -> None:
    """Compile DeepSpeed's ops with the ranks' environment (``tuneq build-ops``)."""
    env = rank_environment(hardware, num_ranks=1, worker_pid=os.getpid())
    subprocess.run([sys.executable, "-m", "worker.deepspeed_ops"], env=env, check=True, timeout=1800)


def launch_command(*, spec_path: Path, num_ranks: int, master_port: int) -> list[str]:
    # ``python -m deepspeed.launcher.runner`` is the ``deepspeed`` console script, run with
    # this interpreter so the ranks get the same environment as the worker.
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(num_ranks),
        "--master_port",
        str(master_port),
        "--module",
        TRAIN_MODULE,
        "--spec",
        str(spec_path),
    ]


# "9.0a" (arch-specific) and "10.0f" (family-specific) are CUDA 12.8+ targets torch accepts,
# but DeepSpeed's op builder reads every entry as "<major>.<minor>[+PTX]" and fails with
# ``ValueError: invalid literal for int()`` on them; its ops use no arch-specific features.
_ARCH_SUFFIX = re.compile(r"^(\d+\.\d+)[af](\+PTX)?$")


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder can parse it: each arch's ``a``/``f``
    suffix dropped, ``+PTX`` kept, anything else left as it was."""
    entries = value.replace(" ", ";").split(";")
    return ";".join(_ARCH_SUFFIX.sub(r"\1\2", entry.strip()) for entry in entries if entry.strip())


def rank_environment(hardware: Hardware, *, num_ranks: int, worker_pid: int) -> dict[str, str]:
    env = dict(os.environ)
    if (given := env.get("TORCH_CUDA_ARCH_LIST")) is not None:
        env["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(given)
        if env["TORCH_CUDA_ARCH_LIST"] != given:
            logger.info("TORCH_CUDA_ARCH_LIST %r is %r for DeepSpeed", given, env["TORCH_CUDA_ARCH_LIST"])
    env["PYTHONUNBUFFERED"] = "1"
    env["TUNEQ_WORKER_PID"] = str(worker_pid)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(OPS_BUILD_DIR))
    if hardware.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # Without this every rank starts one thread per core and they fight for the cores.
        env.setdefault("OMP_NUM_THREADS", str(max(1, hardware.device_count // num_ranks)))
    return env


class RankGroup(Protocol):
    """A job's running ranks, however they were started: ``poll`` is None while they run, then
    the exit status (0 when every rank exited cleanly); ``stop`` ends them all. Once either
    has seen every rank gone, the ranks' shared-memory all-reduce buffers are removed
    (worker.shm_buffers: named by ``master_port``, where the ranks rendezvous), whatever the
    outcome."""

    @property
    def master_port(self) -> int: ...

    @property
    def killed_pids(self) -> frozenset[int]:
        """The ranks tuneq itself SIGKILLed while they ran (a stop's grace ran out)."""
        ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def stop(self, *, grace_seconds: float) -> None: ...


class LauncherRanks:
    """DeepSpeed's launcher and the ranks it started, as the one process group it leads."""

    # launch.py logs its first failing rank's status before it stops the others, so nothing
    # tuneq or launch.py kills afterwards is ever taken for the first failure.
    killed_pids: frozenset[int] = frozenset()

    def __init__(self, process: subprocess.Popen[bytes], *, master_port: int) -> None:
        self.process = process
        self.master_port = master_port

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None:
            remove_job_buffers(self.master_port)  # launch.py exits after its ranks
        return code

    def stop(self, *, grace_seconds: float) -> None:
        """SIGTERM the whole group, wait, then SIGKILL whatever is left of it."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            self.process.wait()
            remove_job_buffers(self.master_port)
            return
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and self.process.poll() is None:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        remove_job_buffers(self.master_port)


class Launcher:
    """Starts one job's ranks at a time for a pool process: forked from its warm start when
    that is up (``TUNEQ_LAUNCHER=warm``), otherwise through DeepSpeed's launcher in a session of
    their own. The warm start comes up (imports) while the process is idle; one that died or
    never came up is replaced for the next job."""

    def __init__(self, *, hardware: Hardware, settings: Settings) -> None:
        self.hardware = hardware
        self.settings_env = settings_environment(settings)
        self._warm: WarmStart | None = None
        if settings.launcher == "warm":
            # The zygote imports with the environment its ranks will have: what torch, DeepSpeed
            # and the Hugging Face libraries read at import time must match.
            env = rank_environment(hardware, num_ranks=1, worker_pid=os.getpid())
            self._warm = WarmStart({**env, **self.settings_env})

    def wait_until_warm(self, *, keep_alive: Callable[[], None], timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Wait for the warm start to finish importing (it usually has: it imports while the
        worker is idle), calling ``keep_alive`` every second, so that a job claimed just after the
        worker started keeps its lease meanwhile. Returns at the timeout regardless: a warm start
        not up by then means DeepSpeed's launcher."""
        deadline = time.monotonic() + timeout
        while self._warm is not None and time.monotonic() < deadline and not self._warm.settled(timeout=1.0):
            keep_alive()

    def launch_ranks(self, *, spec_path: Path, num_ranks: int, log_path: Path, cwd: Path) -> RankGroup:
        """Start one rank per device for the job whose spec is ``spec_path``."""
        env = {**rank_environment(self.hardware, num_ranks=num_ranks, worker_pid=os.getpid()), **self.settings_env}
        master_port = free_port()
        warm = self._usable_warm_start()
        if warm is not None:
            logger.info("forking %d ranks for %s from the warm start", num_ranks, spec_path)
            return warm.fork(
                [
                    RankStart(
                        env=launch_environment(env, rank=rank, num_ranks=num_ranks, master_port=master_port),
                        spec_path=str(spec_path),
                        log_path=str(log_path),
                        cwd=str(cwd),
                        local_rank=rank,
                        title=f"tuneq rank {rank}/{num_ranks} -m {TRAIN_MODULE} --spec {spec_path}",
                    )
                    for rank in range(num_ranks)
                ],
                master_port=master_port,
            )
        cmd = launch_command(spec_path=spec_path, num_ranks=num_ranks, master_port=master_port)
        logger.info("launching %s", " ".join(cmd))
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return LauncherRanks(process, master_port=master_port)

    def close(self) -> None:
        if self._warm is not None:
            self._warm.close()

    def _usable_warm_start(self) -> WarmStart | None:
        if self._warm is None or self._warm.usable():
            return self._warm
        if not self._warm.alive:
            self._warm = WarmStart(self._warm.env)
        return None


def launch_environment(env: dict[str, str], *, rank: int, num_ranks: int, master_port: int) -> dict[str, str]:
    """What DeepSpeed's ``launch.py`` adds for one local rank of a single-node job."""
    return {
        **env,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(num_ranks),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "LOCAL_SIZE": str(num_ranks),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }
