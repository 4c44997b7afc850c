"""Starting and stopping DeepSpeed's own launcher, one process per device, as one process group."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.ports import free_port

logger = logging.getLogger(__name__)

TRAIN_MODULE = "worker.train"


@dataclass(frozen=True)
class HostHardware:
    accelerator: str  # "cuda" or "cpu"
    device_count: int


def detect_hardware() -> HostHardware:
    """Ask torch in a short-lived child, so the worker process itself never initialises CUDA
    (a CUDA context does not survive Celery's fork) and stays free of torch's memory."""
    probe = "import json, torch; print(json.dumps({'cuda': torch.cuda.is_available(), 'n': torch.cuda.device_count()}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    if facts["cuda"] and facts["n"] > 0:
        return HostHardware("cuda", int(facts["n"]))
    return HostHardware("cpu", os.cpu_count() or 1)


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


def rank_environment(hardware: HostHardware, *, num_ranks: int, worker_pid: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["TUNEQ_WORKER_PID"] = str(worker_pid)
    if hardware.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # Without this every rank starts one thread per core and they fight for the cores.
        env.setdefault("OMP_NUM_THREADS", str(max(1, hardware.device_count // num_ranks)))
    return env


def launch_ranks(
    *,
    spec_path: Path,
    num_ranks: int,
    hardware: HostHardware,
    log_path: Path,
    cwd: Path,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start the launcher in its own session, so it and every rank form one process group."""
    cmd = launch_command(spec_path=spec_path, num_ranks=num_ranks, master_port=free_port())
    env = {**rank_environment(hardware, num_ranks=num_ranks, worker_pid=os.getpid()), **(env or {})}
    logger.info("launching %s", " ".join(cmd))
    with log_path.open("ab") as log:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_ranks(process: subprocess.Popen[bytes], *, grace_seconds: float) -> None:
    """SIGTERM the whole group, wait, then SIGKILL whatever is left of it."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
