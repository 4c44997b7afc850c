"""B3: submit → first optimizer step through tuneq ÷ cold ``deepspeed bare_loop.py`` → first step.

Same workload as B1 (model, data, DeepSpeed config, 2 ranks). The cold side is timed from the
moment the launcher command starts to rank 0's end of step 1 (the bare loop writes each step's
wall-clock end); tuneq from just before ``POST /jobs`` to the first metric's ``time``, on an
idle ``tuneq dev`` that has already run one job (a warm service, as users meet it; the first
job also pays the one-off tokenization into the cache, later ones do not). Both use the same
host clock. The job's own status events split tuneq's time into: waiting to be claimed, the
worker's preparation until the launcher starts, and the ranks' start-up to step 1.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

from benchmarks import workload
from benchmarks.results import Check, Result, Stat
from benchmarks.training_runs import TuneqDev, alternate, metric_times, tuneq_dev

STEPS = 2  # step 1 is the figure; one more so both sides end the same way
JOB_TIMEOUT_SECONDS = 1800


@dataclass
class Startup:
    seconds: float
    phases: dict[str, float]


def _cold(work: Path, env: dict[str, str], repeat: int) -> Startup:
    started = time.time()
    recorded, _ = workload.run_reference_script(
        "bare_loop.py", work, env, out=work / f"cold-{repeat}", timeout=JOB_TIMEOUT_SECONDS, steps=STEPS
    )
    return Startup(recorded["step_times"][0] - started, {})


def start_phases(client: httpx.Client, job_id: str, submitted: float, first_step: float) -> dict[str, float]:
    """Seconds spent in each part of the start, from when the job's events were recorded
    (the plan event is recorded when the worker reads it: up to one ingest poll late)."""
    events = client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    at: dict[str, float] = {}
    for e in events:
        key = f"status:{e['data'].get('status')}" if e["type"] == "status" else e["type"]
        at.setdefault(key, datetime.fromisoformat(e["created_at"]).timestamp())
    running = at.get("status:running")
    plan = at.get("plan")  # rank 0's plan event: the ranks are up, data loaded, before initialize
    phases: dict[str, float] = {}
    if running is not None:
        phases["submit to running (claim)"] = running - submitted
        if plan is not None:
            phases["running to the ranks' plan (rank start, data, model)"] = plan - running
            phases["plan to step 1 (engine, first step)"] = first_step - plan
    return phases


def _tuneq(dev: TuneqDev, work: Path, repeat: int) -> Startup:
    submitted = time.time()
    job_id, _ = dev.run_job(workload.job_body(work, name=f"b3-{repeat}", max_steps=STEPS), timeout=JOB_TIMEOUT_SECONDS)
    first_step = metric_times(dev.metrics(job_id))[0]
    return Startup(first_step - submitted, start_phases(dev.client, job_id, submitted, first_step))


def run(repeats: int) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-b3-") as tmp:
        work = Path(tmp)
        env = workload.prepare(work)
        with tuneq_dev(work, env) as dev:
            warm_up = workload.job_body(work, name="b3-first", max_steps=STEPS)
            dev.run_job(warm_up, timeout=JOB_TIMEOUT_SECONDS)  # the service warms up
            cold, warm = alternate(repeats, lambda r: _cold(work, env, r), lambda r: _tuneq(dev, work, r))
    ratios = [w.seconds / c.seconds for w, c in zip(warm, cold, strict=True)]
    phase_names = sorted({name for w in warm for name in w.phases})
    return [
        Result(
            id="B3",
            title="submit → first step through tuneq ÷ cold `deepspeed train.py` → first step",
            checks=[Check("start-up ratio", Stat.of(ratios), "<=", 0.5)],
            details={
                "tuneq_seconds": Stat.of([w.seconds for w in warm]).__dict__,
                "cold_seconds": Stat.of([c.seconds for c in cold]).__dict__,
                "tuneq_phases_median_seconds": {
                    name: statistics.median(w.phases[name] for w in warm if name in w.phases) for name in phase_names
                },
            },
        )
    ]
