"""The ranks' agreement on a stop after a step, for real, on two CPU ranks (gloo): a pause only
one rank's worker asked for (node 0's, in a gang) and a SIGTERM only one rank got are both
everyone's, the more urgent one winning, so every rank leaves after the same step.

Each rank is a spawned child: DeepSpeed's process group lives as long as the process does,
and the recipe's SIGTERM handler would otherwise be installed in pytest's process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

from shared.jobs.hardware import Hardware
from shared.ports import free_port
from worker import launcher
from worker.shm_buffers import remove_job_buffers


def agree_in_child(rank: int, environment: dict[str, str], pause_request: str, results: Any) -> None:
    os.environ.update(environment)
    import deepspeed
    import torch

    from worker.rank.recipe import StopRequested

    deepspeed.init_distributed()
    stop, device = StopRequested(Path(pause_request)), torch.device("cpu")
    agreed = [stop.agreed(device)]  # nobody asked
    if rank == 0:  # only node 0's worker writes the request, on its own disk
        Path(pause_request).touch()
    agreed.append(stop.agreed(device))
    if rank == 1:  # a cancel's SIGTERM reached this rank only (so far)
        os.kill(os.getpid(), signal.SIGTERM)
    agreed.append(stop.agreed(device))
    results.put((rank, [a.name for a in agreed]))


def test_every_rank_agrees_on_the_most_urgent_stop_any_rank_was_asked_for(tmp_path: Path) -> None:
    port = free_port()
    env = launcher.rank_environment(Hardware("cpu", 2), num_ranks=2, worker_pid=0)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    children = [
        context.Process(
            target=agree_in_child,
            args=(
                rank,
                launcher.launch_environment(
                    env, local_rank=rank, num_ranks=2, placement=launcher.NodePlacement(), master_port=port
                ),
                str(tmp_path / f"rank-{rank}" / "pause-requested"),  # each rank's own disk
                results,
            ),
        )
        for rank in range(2)
    ]
    for rank, child in enumerate(children):
        (tmp_path / f"rank-{rank}").mkdir()
        child.start()
    try:
        agreed = dict(results.get(timeout=300) for _ in children)
        for child in children:
            child.join(timeout=60)
            assert child.exitcode == 0
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join()
        remove_job_buffers(port)
    assert agreed == {0: ["none", "pause", "now"], 1: ["none", "pause", "now"]}
