"""B1 (training steps/s through tuneq ÷ the bare DeepSpeed loop) and B6 (peak memory, same ratio).

Each repeat runs the same job twice, alternating which side goes first so drift on a shared
machine hits both: once as ``benchmarks/bare_loop.py`` under DeepSpeed's launcher, once
submitted to a real ``tuneq dev`` (embedded default: SQLite database and broker). Same model,
data, DeepSpeed config, seed, step count and rank environment; tuneq's packing is off so the
batches are the bare loop's (the per-step losses of the two runs are compared to show it).

Steps/s: from the wall-clock time after each optimizer step (rank 0), over the steps after
``WARMUP_STEPS``, so start-up, the final checkpoint and the export are not in it (B3 is the
start-up figure). Memory (``benchmarks.training_runs.PeakMemory``): the peak summed
PSS of the launcher and its ranks for the bare loop, of the ``tuneq worker`` process and
everything under it (Celery's pool child, launcher, ranks) for tuneq.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import workload
from benchmarks.results import Check, Result, Stat
from benchmarks.training_runs import TuneqDev, alternate, metric_times, tuneq_dev

logger = logging.getLogger(__name__)

STEPS = 14
WARMUP_STEPS = 4  # the first steps allocate optimizer state and warm caches
JOB_TIMEOUT_SECONDS = 1800


@dataclass
class Run:
    steps_per_second: float
    peak_pss_bytes: int
    losses: list[float]


def steps_per_second(times: list[float]) -> float:
    """Steps per second between the end of the warm-up and the last step."""
    timed = times[WARMUP_STEPS - 1 :]
    if len(timed) < 2:
        raise ValueError(f"{len(times)} step times: too few to time past {WARMUP_STEPS} warm-up steps")
    return (len(timed) - 1) / (timed[-1] - timed[0])


def _bare_run(work: Path, env: dict[str, str], repeat: int) -> Run:
    out = work / f"bare-{repeat}"
    recorded, memory = workload.run_reference_script(
        "bare_loop.py", work, env, out=out, timeout=JOB_TIMEOUT_SECONDS, steps=STEPS, output=out
    )
    return Run(steps_per_second(recorded["step_times"]), memory.peak, recorded["losses"])


def _tuneq_run(dev: TuneqDev, work: Path, repeat: int) -> Run:
    body = workload.job_body(work, name=f"b1-{repeat}", max_steps=STEPS, log_every_steps=1)
    job_id, memory = dev.run_job(body, timeout=JOB_TIMEOUT_SECONDS)
    metrics = dev.metrics(job_id)
    return Run(steps_per_second(metric_times(metrics)), memory.peak, [m["loss"] for m in metrics])


def _loss_gap(bare: list[float], tuneq: list[float]) -> float:
    """The largest relative difference between the two runs' loss at the same step."""
    return max(abs(a - b) / max(abs(a), 1e-9) for a, b in zip(bare, tuneq, strict=True))


def run(repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-b1-") as tmp:
        work = Path(tmp)
        env = workload.prepare(work)
        params = workload.parameter_count(work / "model")
        with tuneq_dev(work, env) as dev:
            bare_runs, tuneq_runs = alternate(
                repeats, lambda r: _bare_run(work, env, r), lambda r: _tuneq_run(dev, work, r)
            )
    speed = [t.steps_per_second / b.steps_per_second for t, b in zip(tuneq_runs, bare_runs, strict=True)]
    memory = [t.peak_pss_bytes / b.peak_pss_bytes for t, b in zip(tuneq_runs, bare_runs, strict=True)]
    gaps = [_loss_gap(b.losses, t.losses) for t, b in zip(tuneq_runs, bare_runs, strict=True)]
    shared: dict[str, Any] = {
        "model": f"GPT-Neo, hidden {workload.HIDDEN_SIZE}, {workload.LAYERS} layers, {params / 1e6:.1f} M parameters",
        "ranks": workload.RANKS,
        "steps": STEPS,
        "warmup_steps": WARMUP_STEPS,
        "train_batch_size": workload.TRAIN_BATCH_SIZE,
        "max_seq_length": workload.MAX_SEQ_LENGTH,
        "deepspeed_config": workload.deepspeed_config(),
        "max_relative_loss_gap_per_step": Stat.of(gaps).__dict__,
    }
    return [
        Result(
            id="B1",
            title="training steps/s through tuneq ÷ the bare DeepSpeed loop, identical batches",
            checks=[Check("steps/s ratio", Stat.of(speed), ">=", 0.99)],
            details={
                **shared,
                "tuneq_steps_per_second": Stat.of([r.steps_per_second for r in tuneq_runs]).__dict__,
                "bare_steps_per_second": Stat.of([r.steps_per_second for r in bare_runs]).__dict__,
            },
        ),
        Result(
            id="B6",
            title="peak memory (PSS) of worker + ranks ÷ the bare loop's launcher + ranks",
            checks=[Check("peak memory ratio", Stat.of(memory), "<=", 1.1)],
            details={
                **shared,
                "tuneq_peak_mib": statistics.median(r.peak_pss_bytes for r in tuneq_runs) / 2**20,
                "bare_peak_mib": statistics.median(r.peak_pss_bytes for r in bare_runs) / 2**20,
            },
        ),
    ]
