"""Compile the DeepSpeed ops a worker's ranks load, ahead of the first job.

DeepSpeed compiles an op the first time a rank uses it: CPU Adam for ``offload_optimizer``,
fused Adam for optimizers on a GPU, and on a CPU host the shared-memory all-reduce its torch
comm backend loads in ``init_distributed``; a minute or more, inside the first job's startup
(and, for a compiler's gigabytes, in its peak memory).
``tuneq build-ops`` (run by ``make install``) runs this module with the ranks' own environment
(worker.launcher.rank_environment), so the build lands where the ranks look for it: one
directory per virtual environment (``launcher.OPS_BUILD_DIR``) unless TORCH_EXTENSIONS_DIR says
otherwise. An image built with ``DS_BUILD_*`` (Dockerfile.gpu) has these ops compiled into
DeepSpeed itself, and this finds them there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

# ShareMemCommBuilder exists only on the CPU accelerator; on others _op_builders skips it.
OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")


def remember_cpu_info() -> None:
    """Ask py-cpuinfo once per process. Its ``get_cpu_info`` starts a Python subprocess on every
    call (over a second of CPU), and DeepSpeed calls it twice for each op it loads (the ``-march``
    and SIMD flags) and again for each CPU Adam optimizer it makes. The CPU does not change under
    a process, and ranks forked from the warm start inherit the answer."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def _op_builders() -> Iterator[tuple[str, Any]]:
    """Each op of OPS this host's accelerator has: its name and op builder."""
    from deepspeed.accelerator import get_accelerator

    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None:
            yield name, builder


def build_ops() -> list[str]:
    """Load (and compile, where not yet built) every op of OPS this host's accelerator has."""
    remember_cpu_info()
    built = []
    for name, builder in _op_builders():
        if builder.is_compatible():
            builder.load()
            built.append(name)
    return built


def preload_ops() -> list[str]:
    """Load the ops of OPS into this process where that cannot initialise CUDA: for the warm
    start (worker.rank.zygote), whose forked ranks then find them loaded (DeepSpeed keeps the
    ops it loaded per process) instead of each spending seconds in ``torch.utils.cpp_extension``
    checking a JIT build. An op built into DeepSpeed (DS_BUILD_*) is an import; a JIT build is
    loaded (compiled, if ``tuneq build-ops`` did not) only on the CPU accelerator: on a GPU it
    reads the device's compute capability, which initialises CUDA, and forked ranks could not
    use it. An op that fails to load is left to the ranks, which report it as they would."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    remember_cpu_info()
    on_cpu = get_accelerator().device_name() == "cpu"
    loaded = []
    for name, builder in _op_builders():
        if not (installed_ops.get(builder.name) or on_cpu):
            continue
        try:
            if builder.is_compatible():
                builder.load()
                loaded.append(name)
        except Exception:
            logger.warning("could not preload DeepSpeed's %s; the ranks load it themselves", name, exc_info=True)
    return loaded


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("DeepSpeed ops ready: %s", ", ".join(build_ops()) or "none")
