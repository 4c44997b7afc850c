"""What workers can run: one type for a worker's hardware and for what a deployment's live
workers offer together, and the one check a job's request is held to against either.

The API checks a request against every live worker at once (``Hardware.most_of``), so it
refuses only what no worker could run; the worker that claims the job checks it again
against itself, since the job may have been routed before the workers changed.

The DeepSpeed config tuneq chooses (``shared.deepspeed.chosen``) asks the other way round:
not the most a worker offers but what every worker that could run the job has
(``memory_per_rank``, ``supports_bf16``), since the config must fit wherever the job lands.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shared.deepspeed.config import wants_fp16

FP16_NEEDS_CUDA = (
    "fp16 needs a CUDA GPU, and the workers of this deployment have none: set "
    "deepspeed_config.fp16.enabled to false (bf16 works on CPUs), or run on a GPU worker"
)


@dataclass(frozen=True)
class Hardware:
    """A worker's accelerator (``"cuda"`` or ``"cpu"``) and its devices: GPUs, or CPU cores on a
    host without one; the total memory of its smallest device (on a CPU worker the host's, which
    a job's ranks there share) and whether every device computes in bf16 natively. Both are None
    where unknown (a worker row from before workers recorded them).

    For a deployment, the most its live workers offer (``most_of``), the device count of each
    of them (``sizes``: how many could be nodes of a multi-node job), and the workers themselves
    (``workers``: what the ones that could run a given job have)."""

    accelerator: str
    device_count: int
    sizes: tuple[int, ...] = ()
    device_memory_bytes: int | None = None
    bf16_supported: bool | None = None
    workers: tuple[Hardware, ...] = ()

    def workers_with(self, devices: int) -> int:
        """How many of the deployment's workers have at least ``devices`` devices."""
        return sum(size >= devices for size in self.sizes)

    def able_to_run(self, devices: int) -> tuple[Hardware, ...]:
        """The workers a job of ``devices`` ranks a node may land on: those with at least that
        many devices (a job is routed to the smallest such size, and on to the next when that
        size goes away). For one worker, itself."""
        if not self.workers:
            return (self,)
        return tuple(w for w in self.workers if w.device_count >= devices)

    def memory_per_rank(self, ranks_per_node: int) -> int | None:
        """The memory one of a job's ``ranks_per_node`` ranks has wherever the job may run: the
        smallest among the workers that could run it. A GPU rank has its device; the ranks of a
        CPU worker share the host's memory. None where no such worker recorded its memory."""
        if self.workers:
            known = (w.memory_per_rank(ranks_per_node) for w in self.able_to_run(ranks_per_node))
            return min((m for m in known if m is not None), default=None)
        if self.device_memory_bytes is None:
            return None
        if self.accelerator == "cpu":
            return self.device_memory_bytes // max(1, ranks_per_node)
        return self.device_memory_bytes

    def supports_bf16(self, ranks_per_node: int) -> bool:
        """Whether every worker that could run a job of ``ranks_per_node`` ranks a node computes
        in bf16 natively. A worker that did not say (an older row) counts as yes, what tuneq
        assumed before workers said."""
        return all(w.bf16_supported is not False for w in self.able_to_run(ranks_per_node))

    @classmethod
    def most_of(cls, workers: Iterable[Hardware]) -> Hardware | None:
        """CUDA if any worker has it, and the largest device count; None while no worker is
        known (the API then leaves the checks to the worker, which makes them within seconds)."""
        known = tuple(workers)
        if not known:
            return None
        cuda = any(w.accelerator == "cuda" for w in known)
        sizes = tuple(sorted(w.device_count for w in known))
        return cls("cuda" if cuda else "cpu", max(sizes), sizes, workers=known)

    @property
    def device_unit(self) -> str:
        return "GPUs" if self.accelerator == "cuda" else "CPU cores (no GPU)"


@dataclass(frozen=True)
class HardwareProblem:
    """What a request asks for that the hardware cannot give: the field (its place in the job
    request) and a message saying the fix."""

    loc: tuple[str, ...]
    message: str


def hardware_problems(
    *,
    num_gpus: int,
    deepspeed_config: dict[str, Any],
    hardware: Hardware | None,
    whose: str = "the largest worker",
    num_nodes: int = 1,
) -> list[HardwareProblem]:
    """What ``hardware`` (None: unknown, no problem) cannot run of the request; ``whose`` names
    it in the message: the largest worker, or this worker."""
    if hardware is None:
        return []
    problems = []
    if wants_fp16(deepspeed_config) and hardware.accelerator != "cuda":
        problems.append(HardwareProblem(("deepspeed_config", "fp16", "enabled"), FP16_NEEDS_CUDA))
    if num_gpus > hardware.device_count:
        have = hardware.device_count
        problems.append(
            HardwareProblem(
                ("num_gpus",),
                f"num_gpus is {num_gpus} but {whose} has {have} {hardware.device_unit}: ask for at most {have}",
            )
        )
    elif num_nodes > 1 and hardware.sizes and (fit := hardware.workers_with(num_gpus)) < num_nodes:
        problems.append(
            HardwareProblem(
                ("num_nodes",),
                f"num_nodes is {num_nodes} but {fit} live worker(s) have {num_gpus} or more "
                f"{hardware.device_unit}: ask for at most {fit} nodes, or start more workers",
            )
        )
    return problems
