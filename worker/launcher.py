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
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.jobs.hardware import Hardware
from shared.ports import free_port
from shared.settings import Settings
from worker.deepspeed_ops import extensions_dir
from worker.shm_buffers import remove_job_buffers
from worker.warm_start import READY_TIMEOUT_SECONDS, RankStart, WarmStart

logger = logging.getLogger(__name__)

TRAIN_MODULE = "worker.rank.train"


# Run by ``detect_hardware`` in a child: the GPUs torch sees, the smallest one's total memory,
# and whether all compute in bf16 natively. Compute capability 8.0 (Ampere) is where NVIDIA GPUs
# gained bf16 units; older ones (V100, T4) only emulate it, and torch.cuda.is_bf16_supported()
# counts emulation as support by default and asks the current device alone. ROCm: torch's own
# rule (every AMD GPU it builds for has bf16).
GPU_PROBE = """
import json, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
devices = [torch.cuda.get_device_properties(i) for i in range(n)]
print(json.dumps({
    "n": n,
    "memory": min((d.total_memory for d in devices), default=None),
    "bf16": bool(torch.version.hip) or all(d.major >= 8 for d in devices),
}))
"""
# cgroup v2, then v1: a worker in a container may have less memory than its host ("max", or a
# v1 figure past the host's, when unlimited).
_CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def detect_hardware() -> Hardware:
    """Ask torch in a short-lived child, so the worker process itself never initialises CUDA
    (a CUDA context does not survive Celery's fork) and stays free of torch's memory. A torch
    built for CPUs only cannot see a GPU, and saying so needs no import of it (seconds)."""
    if torch_build_has_gpu_support():
        out = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True, timeout=120, check=True)
        if (gpus := gpu_hardware(out.stdout)) is not None:
            return gpus
    return host_hardware()


def gpu_hardware(probe_output: str) -> Hardware | None:
    """The GPUs the probe's last line (its JSON) reports, None when it saw none."""
    facts = json.loads(probe_output.strip().splitlines()[-1])
    if int(facts["n"]) < 1:
        return None
    memory = facts.get("memory")
    return Hardware(
        "cuda", int(facts["n"]), device_memory_bytes=int(memory) if memory else None, bf16_supported=bool(facts["bf16"])
    )


def host_hardware() -> Hardware:
    """A host without GPUs: a device per core, and the host's memory, which the ranks of a job
    share (``Hardware.memory_per_rank`` divides it by the job's ranks, not the cores: a job of
    one rank on a 64-core host has all of it). DeepSpeed's CPU accelerator runs bf16."""
    return Hardware("cpu", os.cpu_count() or 1, device_memory_bytes=host_memory_bytes(), bf16_supported=True)


def host_memory_bytes() -> int:
    """Physical memory, or the worker's cgroup limit where lower."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in _CGROUP_MEMORY_LIMITS:
        with contextlib.suppress(OSError, ValueError):
            memory = min(memory, int(limit.read_text(encoding="ascii").strip()))
    return memory


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


def compile_cache_dirs(cache_dir: Path) -> dict[str, Path]:
    """The environment variables that place torch inductor's and Triton's caches, and where
    they go under a worker's ``cache_dir``."""
    compile_dir = cache_dir / "compile"
    return {"TORCHINDUCTOR_CACHE_DIR": compile_dir / "inductor", "TRITON_CACHE_DIR": compile_dir / "triton"}


def settings_environment(settings: Settings) -> dict[str, str]:
    """What the ranks get from tuneq's settings, beyond the worker's own environment."""
    env = {"HF_ENDPOINT": settings.hf_endpoint}  # hub models come from where hf:// datasets do
    # torch.compile's and Triton's caches (compiled graphs, autotuning, Liger's kernels) in the
    # worker's cache directory, which outlives a container's /tmp: the next job of the same shape,
    # forked from the warm start or not, loads them instead of compiling. An operator's own wins.
    for name, path in compile_cache_dirs(settings.cache_dir).items():
        if name not in os.environ:
            env[name] = str(path)
    if settings.socket_ifname:  # the interface the nodes of a multi-node job talk over
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = settings.socket_ifname
    return env


@dataclass(frozen=True)
class NodePlacement:
    """Where one worker's ranks sit in a job's world: node ``node_rank`` of ``num_nodes``, all
    meeting at ``master_addr:master_port`` (node 0's; shared.db.gangs). The default is a
    one-node job, whose ranks meet on loopback at a free port."""

    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def global_rank(self, local_rank: int, ranks_per_node: int) -> int:
        return self.node_rank * ranks_per_node + local_rank

    def hostfile(self, ranks_per_node: int) -> str:
        """DeepSpeed's hostfile for ``--no_ssh``: the same on every node; the names only order
        the nodes (the ranks meet at the master address)."""
        return "".join(f"node-{n} slots={ranks_per_node}\n" for n in range(self.num_nodes))


ONE_NODE = NodePlacement()  # a one-node job: its ranks meet on loopback


def build_ops(hardware: Hardware) -> None:
    """Compile DeepSpeed's ops with the ranks' environment (``tuneq build-ops``)."""
    env = rank_environment(hardware, num_ranks=1, worker_pid=os.getpid())
    subprocess.run([sys.executable, "-m", "worker.deepspeed_ops"], env=env, check=True, timeout=1800)


def launch_command(
    *, spec_path: Path, num_ranks: int, master_port: int, placement: NodePlacement = ONE_NODE
) -> list[str]:
    """DeepSpeed's launcher for this node's ``num_ranks`` ranks. ``python -m
    deepspeed.launcher.runner`` is the ``deepspeed`` console script, run with this interpreter
    so the ranks get the same environment as the worker. Across nodes it runs in its
    multi-node mode without ssh: every node's worker starts its own node, with one hostfile."""
    command = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if placement.num_nodes > 1:
        hostfile = spec_path.with_name("hostfile")
        hostfile.write_text(placement.hostfile(num_ranks), encoding="utf-8")
        command += ["--no_ssh", "--node_rank", str(placement.node_rank), "--hostfile", str(hostfile)]
        command += ["--master_addr", placement.master_addr]
    else:
        command += ["--num_gpus", str(num_ranks)]
    return [*command, "--master_port", str(master_port), "--module", TRAIN_MODULE, "--spec", str(spec_path)]


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
    env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())
    # torch compiles the ops through ccache where it is installed. Paths under this interpreter's
    # prefix hashed as relative ones, and the build directory left out of the hash (DeepSpeed
    # compiles with -g): an op compiled for one virtual environment is a cache hit in the next
    # (a fresh checkout, a rebuilt image layer) instead of two minutes of compiling on 2 cores.
    env.setdefault("CCACHE_BASEDIR", sys.prefix)
    env.setdefault("CCACHE_NOHASHDIR", "true")
    env["PATH"] = path_with_environment_scripts(env.get("PATH", os.defpath))
    if hardware.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # Without this every rank starts one thread per core and they fight for the cores.
        env.setdefault("OMP_NUM_THREADS", str(max(1, hardware.device_count // num_ranks)))
    return env


def path_with_environment_scripts(path: str) -> str:
    """``PATH`` with this interpreter's scripts directory first (``.venv/bin``), as an activated
    virtual environment has it. torch's JIT runs ``ninja`` from ``PATH``, and DeepSpeed's
    dependency installs it there: without this, a worker or ``tuneq build-ops`` started as
    ``.venv/bin/tuneq`` on a host without a system ninja cannot load an op ("Ninja is required
    to load C++ extensions"), and one with a system ninja of another version rebuilds every op
    whenever the two alternate (each discards the other's build log)."""
    scripts = sysconfig.get_path("scripts")
    entries = [entry for entry in path.split(os.pathsep) if entry and entry != scripts]
    return os.pathsep.join([scripts, *entries])


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

    def launch_ranks(
        self,
        *,
        spec_path: Path,
        num_ranks: int,
        log_path: Path,
        cwd: Path,
        placement: NodePlacement = ONE_NODE,
    ) -> RankGroup:
        """Start one rank per device of this node for the job whose spec is ``spec_path``."""
        env = {**rank_environment(self.hardware, num_ranks=num_ranks, worker_pid=os.getpid()), **self.settings_env}
        master_port = placement.master_port or free_port()
        world_size = placement.num_nodes * num_ranks
        warm = self._usable_warm_start()
        if warm is not None:
            logger.info("forking %d ranks for %s from the warm start", num_ranks, spec_path)
            return warm.fork(
                [
                    RankStart(
                        env=launch_environment(
                            env, local_rank=rank, num_ranks=num_ranks, placement=placement, master_port=master_port
                        ),
                        spec_path=str(spec_path),
                        log_path=str(log_path),
                        cwd=str(cwd),
                        local_rank=rank,
                        title=(
                            f"tuneq rank {placement.global_rank(rank, num_ranks)}/{world_size} "
                            f"-m {TRAIN_MODULE} --spec {spec_path}"
                        ),
                    )
                    for rank in range(num_ranks)
                ],
                master_port=master_port,
            )
        cmd = launch_command(spec_path=spec_path, num_ranks=num_ranks, master_port=master_port, placement=placement)
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


def launch_environment(
    env: dict[str, str], *, local_rank: int, num_ranks: int, placement: NodePlacement, master_port: int
) -> dict[str, str]:
    """What DeepSpeed's ``launch.py`` adds for one of this node's ``num_ranks`` ranks (its
    multi-node mode with ``--node_rank``, when the job spans nodes)."""
    return {
        **env,
        "MASTER_ADDR": placement.master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(placement.num_nodes * num_ranks),
        "CROSS_RANK": str(placement.node_rank),
        "CROSS_SIZE": str(placement.num_nodes),
        "LOCAL_SIZE": str(num_ranks),
        "RANK": str(placement.global_rank(local_rank, num_ranks)),
        "LOCAL_RANK": str(local_rank),
    }
