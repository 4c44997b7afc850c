"""B10: DPO through tuneq ÷ TRL's ``DPOTrainer`` under DeepSpeed (issue 42's benchmark).

Three sides, each run once a repeat, the order reversed every other repeat so drift on a
shared machine hits all of them: (a) a DPO job submitted to a real ``tuneq dev``; (b)
``benchmarks/trl_dpo_loop.py`` under DeepSpeed's launcher, TRL's default reference (a second
model, run on every step); (c) the same with ``precompute_ref_log_probs=True``. Same model (the
workload's 25.5 M GPT-Neo), preference pairs (``cli.samples.write_preference_dataset``: 256 to
train on, 64 held out from another seed), ``max_seq_length``, DeepSpeed config (the workload's
ZeRO-2 with the CPU-offloaded optimizer, fp32, ``train_batch_size`` 8 pairs), beta, learning
rate, step count and rank environment.

Steps/s, alike on every side: from the wall-clock end of each optimizer step (tuneq: the
metric's ``time``; TRL: a callback's ``on_step_end``), over steps ``WARMUP_STEPS`` to
``STEPS - 1``. The first steps warm caches up; the last is left out because tuneq stamps its
final metric after the evaluation on the held-out pairs (TRL evaluates after ``train()``).
Neither reference pass is in it: tuneq scores the reference before step 1 (its ``phase``
events time it, reported beside), TRL's (c) while the trainer is built. Memory: the peak summed
PSS of each side's process tree over the whole run (``training_runs.PeakMemory``: the launcher
and its ranks; the ``tuneq worker`` and everything under it). Held-out reward accuracy: the
share of held-out pairs whose chosen answer earns the higher reward at the end (tuneq: the last
metric's ``eval_rewards/accuracies``; TRL: ``evaluate()``'s, after training).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import workload
from benchmarks.common import REPO
from benchmarks.results import Check, Result, Stat
from benchmarks.training_runs import TuneqDev, launch_script, metric_times, tuneq_dev
from cli.samples import seed_config, write_preference_dataset
from worker import launcher

logger = logging.getLogger(__name__)

PAIRS = 256
HELD_OUT_PAIRS = 64
HELD_OUT_SEED = workload.SEED + 1
MAX_SEQ_LENGTH = 128
TRAIN_BATCH_SIZE = 8  # pairs a step: 2 ranks x micro-batch 4
LEARNING_RATE = 1e-6  # DPOConfig's default
BETA = 0.1
STEPS = 24
WARMUP_STEPS = 4
JOB_TIMEOUT_SECONDS = 1800
T = TypeVar("T")


@dataclass
class Run:
    steps_per_second: float
    peak_pss_bytes: int
    held_out_accuracy: float
    held_out_loss: float
    losses: list[float]
    step_seconds: list[float] = field(default_factory=list)  # each timed step's duration
    load_average: float | None = None  # the host's 1-minute load average as the run started
    reference_seconds: float | None = None  # tuneq: the reference pass, from its phase events
    init_seconds: float | None = None  # TRL: building the trainer (tokenizing; the reference model or pass)


def deepspeed_config() -> dict[str, Any]:
    return seed_config(fp16=False, train_batch_size=TRAIN_BATCH_SIZE, lr=LEARNING_RATE)


def prepare(work: Path) -> dict[str, str]:
    """Model, ``pairs.jsonl``, ``held_out.jsonl`` and ``ds_config.json`` in ``work``, the op
    built; the ranks' environment (the workload's)."""
    workload.build_model(work / "model")
    write_preference_dataset(work / "pairs.jsonl", records=PAIRS, seed=workload.SEED)
    write_preference_dataset(work / "held_out.jsonl", records=HELD_OUT_PAIRS, seed=HELD_OUT_SEED)
    (work / "ds_config.json").write_text(json.dumps(deepspeed_config()))
    launcher.build_ops(launcher.detect_hardware())
    return workload.rank_environment()


def steady_steps_per_second(times: Sequence[float]) -> float:
    """Steps per second from the end of the warm-up to the end of the step before the last."""
    timed = list(times)[WARMUP_STEPS - 1 : -1]
    if len(timed) < 2:
        raise ValueError(f"{len(times)} step times: too few to time past {WARMUP_STEPS} warm-up steps and the last")
    return (len(timed) - 1) / (timed[-1] - timed[0])


def timed_step_seconds(times: Sequence[float]) -> list[float]:
    """Each timed step's duration (the steps ``steady_steps_per_second`` times)."""
    timed = list(times)[WARMUP_STEPS - 1 : -1]
    return [b - a for a, b in pairwise(timed)]


def in_turn(repeats: int, sides: Sequence[Callable[[int], T]]) -> list[list[T]]:
    """Each side's runs, one a repeat, in the given order on even repeats and reversed on odd ones."""
    runs: list[list[T]] = [[] for _ in sides]
    for repeat in range(repeats):
        order = range(len(sides)) if repeat % 2 == 0 else reversed(range(len(sides)))
        for index in order:
            runs[index].append(sides[index](repeat))
    return runs


def measure(metric: dict[str, Any], name: str) -> Any:
    """A DPO measure of a metric row by TRL's name (rewards/accuracies), or as a column spells it
    (rewards_accuracies); None when neither is there."""
    value = metric.get(name)
    return metric.get(name.replace("/", "_")) if value is None else value


def final_measure(metrics: Sequence[dict[str, Any]], name: str) -> float:
    """The last reported value of a measure (``eval_rewards/accuracies``, ``eval_loss``)."""
    found = [v for m in metrics if (v := measure(m, name)) is not None]
    if not found:
        raise ValueError(f"no metric carries {name}: was the held-out set evaluated?")
    return float(found[-1])


def loss_gap(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest relative difference between two runs' loss at the same step."""
    return max(abs(x - y) / max(abs(y), 1e-9) for x, y in zip(a, b, strict=True))


def reference_pass_seconds(events: Sequence[dict[str, Any]]) -> float | None:
    """From the first ``reference_logps`` phase event to the one with every pair done; None when
    the scores were found cached or the events do not say."""
    phases = [e["data"] for e in events if e["type"] == "phase" and e["data"].get("name") == "reference_logps"]
    if not phases or any(p.get("cached") for p in phases):
        return None
    done = [p for p in phases if p["done"] == p["total"]]
    if not done:
        return None
    return datetime.fromisoformat(done[-1]["time"]).timestamp() - datetime.fromisoformat(phases[0]["time"]).timestamp()


@dataclass
class TrlLog:
    step_times: list[float]
    losses: list[float]
    held_out_accuracy: float
    held_out_loss: float
    summary: dict[str, Any]


def read_trl_log(lines: Sequence[str]) -> TrlLog:
    """``trl_dpo_loop.py``'s JSON Lines: a training step's log has ``loss``, the final evaluation's
    ``eval_rewards/accuracies``, the last line the summary."""
    records = [json.loads(line) for line in lines if line.strip()]
    steps = [r for r in records if "loss" in r]
    evaluations = [r for r in records if "eval_rewards/accuracies" in r]
    summaries = [r["summary"] for r in records if "summary" in r]
    if not evaluations or not summaries:
        raise ValueError("the TRL run's log has no evaluation or no summary: did it finish?")
    return TrlLog(
        step_times=[float(r["time"]) for r in steps],
        losses=[float(r["loss"]) for r in steps],
        held_out_accuracy=float(evaluations[-1]["eval_rewards/accuracies"]),
        held_out_loss=float(evaluations[-1]["eval_loss"]),
        summary=summaries[-1],
    )


def _trl_run(work: Path, env: dict[str, str], repeat: int, *, precompute: bool) -> Run:
    out = work / f"trl-{'precompute' if precompute else 'reference'}-{repeat}"
    out.mkdir()
    times = out / "log.jsonl"
    args = [
        *("--model", str(work / "model"), "--data", str(work / "pairs.jsonl")),
        *("--eval-data", str(work / "held_out.jsonl"), "--config", str(work / "ds_config.json")),
        *("--max-seq-length", str(MAX_SEQ_LENGTH), "--seed", str(workload.SEED), "--times", str(times)),
        *("--steps", str(STEPS), "--beta", str(BETA), "--output", str(out)),
        *(["--precompute-ref-log-probs"] if precompute else []),
    ]
    # Datasets' cache (where TRL keeps precomputed reference log-probabilities) in the run's own
    # directory: no run finds another's.
    run_env = {**env, "HF_DATASETS_CACHE": str(out / "datasets")}
    load = os.getloadavg()[0]
    memory = launch_script(
        REPO / "benchmarks" / "trl_dpo_loop.py",
        args,
        ranks=workload.RANKS,
        env=run_env,
        cwd=out,
        timeout=JOB_TIMEOUT_SECONDS,
    )
    log = read_trl_log(times.read_text().splitlines())
    return Run(
        steps_per_second=steady_steps_per_second(log.step_times),
        step_seconds=timed_step_seconds(log.step_times),
        load_average=load,
        peak_pss_bytes=memory.peak,
        held_out_accuracy=log.held_out_accuracy,
        held_out_loss=log.held_out_loss,
        losses=log.losses,
        init_seconds=float(log.summary["init_seconds"]),
    )


def job_body(work: Path, *, name: str) -> dict[str, Any]:
    """tuneq's DPO job for the workload in ``work``."""
    return {
        "name": name,
        "model": str(work / "model"),
        "dataset": str(work / "pairs.jsonl"),
        "validation_dataset": str(work / "held_out.jsonl"),
        "deepspeed_config": deepspeed_config(),
        "num_gpus": workload.RANKS,
        "training": {
            "method": "dpo",
            "dpo": {"beta": BETA},
            "max_seq_length": MAX_SEQ_LENGTH,
            "seed": workload.SEED,
            "max_steps": STEPS,
            "log_every_steps": 1,
        },
    }


def _tuneq_run(dev: TuneqDev, work: Path, repeat: int) -> Run:
    # Every run scores its reference, as every TRL run does: none finds an earlier run's in the cache.
    shutil.rmtree(dev.home / "cache" / "reference", ignore_errors=True)
    load = os.getloadavg()[0]
    job_id, memory = dev.run_job(job_body(work, name=f"b10-{repeat}"), timeout=JOB_TIMEOUT_SECONDS)
    metrics = dev.metrics(job_id)
    events = dev.client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    return Run(
        steps_per_second=steady_steps_per_second(metric_times(metrics)),
        step_seconds=timed_step_seconds(metric_times(metrics)),
        load_average=load,
        peak_pss_bytes=memory.peak,
        held_out_accuracy=final_measure(metrics, "eval_rewards/accuracies"),
        held_out_loss=final_measure(metrics, "eval_loss"),
        losses=[m["loss"] for m in metrics],
        reference_seconds=reference_pass_seconds(events),
    )


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _side_details(runs: Sequence[Run]) -> dict[str, Any]:
    return {
        "steps_per_second": Stat.of([r.steps_per_second for r in runs]).__dict__,
        "peak_mib": Stat.of([r.peak_pss_bytes / 2**20 for r in runs]).__dict__,
        "held_out_reward_accuracy": [r.held_out_accuracy for r in runs],
        "held_out_loss": [r.held_out_loss for r in runs],
        "first_and_last_loss": [[r.losses[0], r.losses[-1]] for r in runs],
        "reference_pass_seconds": [r.reference_seconds for r in runs],
        "trainer_init_seconds": [r.init_seconds for r in runs],
        "load_average_at_start": [r.load_average for r in runs],
        "timed_step_seconds": [[round(s, 4) for s in r.step_seconds] for r in runs],
    }


def _speed(run: Run) -> float:
    return run.steps_per_second


def _peak(run: Run) -> float:
    return run.peak_pss_bytes


def _init(run: Run) -> float:
    assert run.init_seconds is not None  # every TRL run reports it
    return run.init_seconds


def _ratios(pairs: Sequence[tuple[Run, Run]], figure: Callable[[Run], float]) -> Stat:
    """tuneq's figure ÷ the other side's, a repeat at a time."""
    return Stat.of([figure(tuneq) / figure(other) for tuneq, other in pairs])


def run(repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-b10-") as tmp:
        work = Path(tmp)
        env = prepare(work)
        params = workload.parameter_count(work / "model")
        with tuneq_dev(work, env) as dev:
            tuneq, trl, trl_pre = in_turn(
                repeats,
                [
                    lambda r: _tuneq_run(dev, work, r),
                    lambda r: _trl_run(work, env, r, precompute=False),
                    lambda r: _trl_run(work, env, r, precompute=True),
                ],
            )
    vs_trl = list(zip(tuneq, trl, strict=True))
    vs_pre = list(zip(tuneq, trl_pre, strict=True))
    details: dict[str, Any] = {
        "model": f"GPT-Neo, hidden {workload.HIDDEN_SIZE}, {workload.LAYERS} layers, {params / 1e6:.1f} M parameters",
        "ranks": workload.RANKS,
        "pairs": PAIRS,
        "held_out_pairs": HELD_OUT_PAIRS,
        "steps": STEPS,
        "timed_steps": f"{WARMUP_STEPS}..{STEPS - 1}",
        "beta": BETA,
        "max_seq_length": MAX_SEQ_LENGTH,
        "deepspeed_config": deepspeed_config(),
        "peak_memory_ratio_to_trl_precomputed": _ratios(vs_pre, _peak).__dict__,
        # TRL's reference pass, (c) building its trainer less (b) building its own (both tokenize).
        "trl_precompute_seconds": _median([_init(c) - _init(b) for b, c in zip(trl, trl_pre, strict=True)]),
        # The same batches on every side: the per-step losses agree.
        "max_relative_loss_gap_per_step_to_trl": Stat.of([loss_gap(a.losses, b.losses) for a, b in vs_trl]).__dict__,
        "tuneq": _side_details(tuneq),
        "trl_reference_model": _side_details(trl),
        "trl_precomputed": _side_details(trl_pre),
    }
    accuracy = "held-out reward accuracy"
    checks = [
        Check("steps/s ratio ÷ TRL", _ratios(vs_trl, _speed), ">=", 1.0),
        Check("steps/s ratio ÷ TRL precomputed", _ratios(vs_pre, _speed), ">=", 1.0),
        Check("peak memory ratio ÷ TRL", _ratios(vs_trl, _peak), "<=", 1.0),
        Check.reported(f"{accuracy}, tuneq", Stat.of([r.held_out_accuracy for r in tuneq])),
        Check.reported(f"{accuracy}, TRL", Stat.of([r.held_out_accuracy for r in trl])),
        Check.reported(f"{accuracy}, TRL precomputed", Stat.of([r.held_out_accuracy for r in trl_pre])),
    ]
    title = "DPO through tuneq ÷ TRL's DPOTrainer + DeepSpeed: steps/s, peak memory; held-out reward accuracy"
    return [Result(id="B10", title=title, checks=checks, details=details)]
