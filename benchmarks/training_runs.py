"""Running one training job both ways, measured alike: a script under DeepSpeed's launcher,
and a job through a real ``tuneq dev``. B1, B2, B6 and ``benchmarks/gpu.sh`` are built on it.

Memory is sampled the same way for both: the summed proportional set size (PSS: shared pages
split between the processes that map them, so a forked process is not counted twice) of a
process tree, and, on a CUDA host, the memory in use on the GPUs (``nvidia-smi``); the peak
over the run is kept.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

from benchmarks.common import Server, keep_log
from shared.jobs.run_layout import RunLayout
from shared.jobs.status import TERMINAL_STATUSES
from shared.ports import free_port
from shared.settings import Settings
from worker.shm_buffers import remove_job_buffers

# Reading a process's PSS walks its page tables (~0.1 s for a rank under load): sampled once a
# second, so the sampler's own CPU stays small next to the ranks' (memory peaks last a step).
SAMPLE_SECONDS = 1.0
JOB_TIMEOUT_SECONDS = 3600
A = TypeVar("A")
B = TypeVar("B")


def pss_bytes(process: psutil.Process) -> int:
    """Proportional set size, from ``smaps_rollup`` (one summary line) where Linux has it."""
    try:
        with open(f"/proc/{process.pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024  # kB
    except FileNotFoundError:
        pass
    return int(process.memory_full_info().pss)


def gpu_memory_used_bytes() -> int | None:
    """Memory in use on every GPU of this host together, or None where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return sum(int(float(v)) for v in out.split()) * 2**20  # MiB


class PeakMemory:
    """The largest summed PSS of a process and its descendants (and GPU memory), sampled in a thread."""

    def __init__(self, root: psutil.Process) -> None:
        self.root = root
        self.peak = 0
        self.gpu_peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def _sample(self) -> None:
        gpu_baseline = gpu_memory_used_bytes()  # what other processes already hold
        while not self._stop.is_set():
            total = 0
            try:
                tree = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for process in tree:
                with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                    total += pss_bytes(process)  # a process that just ended counts 0
            self.peak = max(self.peak, total)
            gpu = gpu_memory_used_bytes()
            if gpu is not None and gpu_baseline is not None:
                self.gpu_peak = max(self.gpu_peak or 0, gpu - gpu_baseline)
            self._stop.wait(SAMPLE_SECONDS)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


def launch_script(
    script: Path, args: Sequence[str], *, ranks: int, env: dict[str, str], cwd: Path, timeout: float
) -> PeakMemory:
    """``deepspeed --num_gpus RANKS script ARGS``, as a user would type it; its peak memory.
    The /dev/shm all-reduce buffers its ranks leave (DeepSpeed never unlinks them) are removed."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(port)]
    cmd += [str(script), *args]
    log = cwd / f"{script.stem}.log"
    with log.open("wb") as f:
        process = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    try:
        with PeakMemory(psutil.Process(process.pid)) as memory:
            code = process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        remove_job_buffers(port)
    if code != 0:
        raise RuntimeError(f"{script.name} exited with {code}; see {keep_log(log, script.stem)}")
    return memory


class TuneqDev:
    """A real ``tuneq dev`` on the embedded default (SQLite database and broker) in ``home``."""

    def __init__(self, server: Server, log: Path, home: Path) -> None:
        self.server = server
        self.log = log
        self.home = home
        self.client = httpx.Client(base_url=server.base_url, timeout=30)

    def worker_process(self) -> psutil.Process:
        """``tuneq dev`` starts ``serve`` and ``worker``; the worker is the one measured."""
        for child in psutil.Process(self.server.process.pid).children():
            # "tuneq worker", which Celery retitles "[celeryd: …] (worker)" where setproctitle is
            # installed; whole words only: the API's command line has "--workers 1"
            if is_worker_command(child.cmdline()):
                return child
        found = [c.cmdline() for c in psutil.Process(self.server.process.pid).children()]
        raise RuntimeError(f"tuneq dev has no worker process among {found}")

    def run_job(self, body: dict[str, Any], *, timeout: float = JOB_TIMEOUT_SECONDS) -> tuple[str, PeakMemory]:
        """Submit, wait for success; the job id and the worker tree's peak memory meanwhile."""
        with PeakMemory(self.worker_process()) as memory:
            response = self.client.post("/jobs", json=body)
            if response.status_code != 201:
                raise RuntimeError(f"POST /jobs answered {response.status_code}: {response.text}")
            job_id = str(response.json()["id"])
            deadline = time.monotonic() + timeout
            while (job := self.client.get(f"/jobs/{job_id}").json())["status"] not in TERMINAL_STATUSES:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} still {job['status']} after {timeout} s")
                time.sleep(0.5)
        if job["status"] != "succeeded":
            kept = keep_log(self.log, "tuneq-dev")
            raise RuntimeError(f"tuneq job {job_id} {job['status']}: {job.get('error')} (log: {kept})")
        return job_id, memory

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.client.get(f"/jobs/{job_id}/metrics").json()["data"])

    def plan(self, job_id: str) -> dict[str, Any]:
        """The job's plan event (steps, rows, the kernels applied, whether it compiled)."""
        events = self.client.get(f"/jobs/{job_id}/events").json()["data"]
        return next((dict(e["data"]) for e in events if e["type"] == "plan"), {})

    def model_dir(self, job_id: str) -> Path:
        """Where the job's final Hugging Face model was exported."""
        checkpoints = self.client.get(f"/jobs/{job_id}/checkpoints").json()["data"]
        exported = [c for c in checkpoints if c["kind"] == "model"]
        if not exported:
            raise RuntimeError(f"job {job_id} exported no model: {checkpoints}")
        return Path(exported[-1]["uri"])  # a local path on the embedded default

    def run_dir(self, job_id: str) -> Path:
        """The job's run directory: its spec, logs, checkpoints and exported model."""
        return RunLayout.for_job(Settings(home=self.home), job_id).root


def is_worker_command(cmdline: Sequence[str]) -> bool:
    """Whether a ``tuneq dev`` child's command line is its worker's: ``… cli.main worker``, or as
    Celery retitles it, ``[celeryd: …] (worker)``; not ``… cli.main serve … --workers 1``."""
    words = " ".join(cmdline).split()  # a retitled process may hold its title in one argument
    return "worker" in words or "(worker)" in words


def metric_times(metrics: list[dict[str, Any]]) -> list[float]:
    """Each reported step's wall-clock end, as POSIX seconds."""
    return [datetime.fromisoformat(m["time"]).timestamp() for m in metrics]


@contextlib.contextmanager
def tuneq_dev(work: Path, env: dict[str, str], *, home_name: str = "home") -> Iterator[TuneqDev]:
    """``tuneq dev`` in ``work/<home_name>``, allowed to read models and data anywhere under
    ``work`` (several may run side by side, each in its own home)."""
    home = work / home_name
    home.mkdir(exist_ok=True)
    dev_env = {**env, "TUNEQ_HOME": str(home), "TUNEQ_AUTH": "off", "TUNEQ_ALLOWED_ROOTS": str(work)}
    for var in ("TUNEQ_DATABASE_URL", "TUNEQ_BROKER_URL"):  # the embedded default
        dev_env.pop(var, None)
    log = work / f"tuneq-dev-{home_name}.log" if home_name != "home" else work / "tuneq-dev.log"
    port = free_port()
    argv = [sys.executable, "-m", "cli.main", "dev", "--port", str(port)]
    with Server(argv, env=dev_env, log=log, port=port) as server:
        server.wait_ready("/readyz")
        try:
            yield TuneqDev(server, log, home)
        except Exception:
            keep_log(log, "tuneq-dev")
            raise


def alternate(repeats: int, first: Callable[[int], A], second: Callable[[int], B]) -> tuple[list[A], list[B]]:
    """Run both sides once a repeat, swapping which goes first, so drift on a shared machine hits both."""
    a: list[A] = []
    b: list[B] = []
    for repeat in range(repeats):
        if repeat % 2 == 0:
            a.append(first(repeat))
            b.append(second(repeat))
        else:
            b.append(second(repeat))
            a.append(first(repeat))
    return a, b
