"""What workers can run: one type for a worker's hardware and for what a deployment's live
workers offer together, and the one check a job's request is held to against either.

The API checks a request against every live worker at once (``Hardware.most_of``), so it
refuses only what no worker could run; the worker that claims the job checks it again
against itself, since the job may have been routed before the workers changed.
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
    host without one. For a deployment, the most its live workers offer (``most_of``), and the
    device count of each of them (``sizes``: how many could be nodes of a multi-node job)."""

    accelerator: str
    device_count: int
    sizes: tuple[int, ...] = ()

    def workers_with(self, devices: int) -> int:
        """How many of the deployment's workers have at least ``devices`` devices."""
        return sum(size >= devices for size in self.sizes)

    @classmethod
    def most_of(cls, workers: Iterable[Hardware]) -> Hardware | None:
        """CUDA if any worker has it, and the largest device count; None while no worker is
        known (the API then leaves the checks to the worker, which makes them within seconds)."""
        known = list(workers)
        if not known:
            return None
        cuda = any(w.accelerator == "cuda" for w in known)
        sizes = tuple(sorted(w.device_count for w in known))
        return cls("cuda" if cuda else "cpu", max(sizes), sizes)

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
