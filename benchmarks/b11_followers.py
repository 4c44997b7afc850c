"""B11b: 1,000 SSE followers of 50 running jobs, event latency from the line to the client.

B5's SSE measurement (``benchmarks/b5_events.py``) at the scale issue 43 asks: ``JOBS`` running
jobs of one owner, ``FOLLOWERS_PER_JOB`` streams of ``GET /jobs/{id}/events/stream`` each, on
``tuneq serve`` with keys on (``benchmarks/keyed_deployment.py``). The followers run in their
own process (``benchmarks/sse_followers.py``, raw HTTP/1.1). Once every stream has its response
headers (+1 s), ``ROUNDS`` rounds ``ROUND_SECONDS`` apart: in each, job after job gets
``EVENTS_PER_BATCH`` metric lines, stamped with the time they are written, appended to its
events file and ingested at once by the worker's own ``worker.ingest.EventIngestor.poll`` (one
transaction, then the Redis wake-up). Each follower records arrival minus the line's stamp
(same host clock), so a latency covers ingest + commit + wake-up + the stream's read +
delivery; the figure is the p99 over every follower and event of a repeat.

``python -m benchmarks.b11_followers --tree before=/tmp/b11-before --tree after=.`` measures
several checkouts' servers side by side (the ingest is this checkout's worker code either way).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.b9_load import CpuMeter
from benchmarks.common import REDIS_URL, REPO, metric_line, percentile
from benchmarks.keyed_deployment import KeyedDeployment, keyed_deployment, trees_argument
from benchmarks.results import Check, Result, Stat

logger = logging.getLogger(__name__)

OWNER = "bench"
JOBS = 50
FOLLOWERS_PER_JOB = 20
ROUNDS = 20
ROUND_SECONDS = 0.5
EVENTS_PER_BATCH = 2
STEPS = ROUNDS * EVENTS_PER_BATCH  # each job's, over the run
TARGET_P99_MS = 100.0
FOLLOWER_TIMEOUT = 300.0


@dataclass
class Following:
    """One repeat's figures on one deployment."""

    p50_ms: float
    p99_ms: float
    max_ms: float
    samples: int  # every follower's events
    connect_seconds: float  # until every stream had its headers
    ingest_ms_per_poll: float  # the benchmark's own side: write + EventIngestor.poll, mean
    load_average: float  # 1-minute, at its end
    # CPU during the rounds, in cores (CPU seconds ÷ seconds): the API's processes, the Postgres
    # backends serving them, this process's ingest; and the share of the host's cores busy
    api_cores: float
    postgres_cores: float
    ingest_cores: float
    host_busy_share: float
    round_p99_ms: list[float]  # of each round's events: a spike or a steady tail


class RunningJobs:
    """``JOBS`` running jobs of ``OWNER`` in the deployment's schema, and each one's ingestor,
    as a worker has them (this process's tuneq settings point at the deployment)."""

    def __init__(self, deployment: KeyedDeployment) -> None:
        from sqlmodel import Session

        from shared.db.engine import make_engine
        from shared.db.models import Job
        from shared.jobs.status import JobStatus
        from shared.settings import get_settings
        from worker.ingest import EventIngestor

        for key, value in {
            "TUNEQ_HOME": str(deployment.home),
            "TUNEQ_DATABASE_URL": deployment.database_url,
            "TUNEQ_BROKER_URL": REDIS_URL,
        }.items():
            os.environ[key] = value
        get_settings.cache_clear()
        self.engine = make_engine(deployment.database_url)
        jobs = [
            Job(
                owner=OWNER,
                name=f"bench-follow-{n:02d}",
                status=JobStatus.running,
                model="/srv/models/gpt-neo",
                dataset="/srv/data/train.jsonl",
                deepspeed_config={"train_batch_size": 8},
                num_gpus=2,
                training={"epochs": 1},
            )
            for n in range(JOBS)
        ]
        with Session(self.engine) as session:
            session.add_all(jobs)
            session.commit()
            self.ids: list[uuid.UUID] = [job.id for job in jobs]
        self.paths = {job_id: deployment.home / f"events-{job_id}.jsonl" for job_id in self.ids}
        for path in self.paths.values():
            path.touch()
        self.ingestors = {
            job_id: EventIngestor(events_path=self.paths[job_id], log_path=None, job_id=job_id) for job_id in self.ids
        }

    def round(self, first_step: int) -> float:
        """Each job's next batch of metric lines, written then ingested; the seconds it took."""
        from sqlmodel import Session

        started = time.perf_counter()
        for job_id in self.ids:
            with self.paths[job_id].open("a") as f:
                lines = (metric_line(first_step + i, steps=STEPS) + "\n" for i in range(EVENTS_PER_BATCH))
                f.writelines(lines)
            with Session(self.engine) as session:
                self.ingestors[job_id].poll(session)
        return time.perf_counter() - started

    def close(self) -> None:
        self.engine.dispose()


def _followers(deployment: KeyedDeployment, jobs: RunningJobs) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "benchmarks.sse_followers", deployment.server.base_url]
    argv += [arg for job_id in jobs.ids for arg in ("--job", str(job_id))]
    argv += ["--per-job", str(FOLLOWERS_PER_JOB), "--events", str(ROUNDS * EVENTS_PER_BATCH)]
    argv += ["--header", deployment.authorization, "--timeout", str(FOLLOWER_TIMEOUT)]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@dataclass
class Rounds:
    """What driving the rounds took: each round's seconds, and the CPU seconds used meanwhile."""

    spent: list[float]
    seconds: float
    api_cpu: float
    postgres_cpu: float
    ingest_cpu: float
    host_busy_share: float


def _drive(deployment: KeyedDeployment, jobs: RunningJobs) -> Rounds:
    """``ROUNDS`` rounds of every job's metric lines, ``ROUND_SECONDS`` apart."""
    meter, ingest_cpu, started = CpuMeter(deployment.server), time.process_time(), time.monotonic()
    meter.start()
    spent = []
    for n in range(ROUNDS):
        spent.append(jobs.round(first_step=1 + n * EVENTS_PER_BATCH))
        time.sleep(max(0.0, ROUND_SECONDS - spent[-1]))
    api_cpu, postgres_cpu, busy = meter.stop()
    return Rounds(spent, time.monotonic() - started, api_cpu, postgres_cpu, time.process_time() - ingest_cpu, busy)


def _following(answer: dict[str, list[Any]], connect_seconds: float, rounds: Rounds) -> Following:
    """The figures of the followers' answer (every latency, and the step it is of)."""
    latencies = [s * 1000 for s in answer["latencies"]]
    expected = JOBS * FOLLOWERS_PER_JOB * ROUNDS * EVENTS_PER_BATCH
    if len(latencies) != expected:
        raise RuntimeError(f"{len(latencies)} latencies, {expected} expected")
    by_round: dict[int, list[float]] = {}
    for step, latency in zip(answer["steps"], latencies, strict=True):
        by_round.setdefault((step - 1) // EVENTS_PER_BATCH, []).append(latency)
    return Following(
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        max_ms=max(latencies),
        samples=len(latencies),
        connect_seconds=connect_seconds,
        ingest_ms_per_poll=sum(rounds.spent) * 1000 / (ROUNDS * JOBS),
        load_average=os.getloadavg()[0],
        api_cores=rounds.api_cpu / rounds.seconds,
        postgres_cores=rounds.postgres_cpu / rounds.seconds,
        ingest_cores=rounds.ingest_cpu / rounds.seconds,
        host_busy_share=rounds.host_busy_share,
        round_p99_ms=[round(percentile(by_round[n], 99), 1) for n in sorted(by_round)],
    )


def measure(deployment: KeyedDeployment) -> Following:
    """The followers connected, then the rounds driven, on one deployment."""
    jobs = RunningJobs(deployment)
    started = time.monotonic()
    followers = _followers(deployment, jobs)
    try:
        assert followers.stdout is not None
        ready = followers.stdout.readline()  # blocks until every stream is open, or the process ends
        if not ready.startswith("ready "):
            raise RuntimeError(f"the followers did not connect: {followers.communicate(timeout=60)[1][-2000:]}")
        connect_seconds = time.monotonic() - started
        time.sleep(1.0)  # every stream past its first read, its feed subscribed to the wake-ups
        rounds = _drive(deployment, jobs)
        out, err = followers.communicate(timeout=FOLLOWER_TIMEOUT)
        if followers.returncode != 0:
            raise RuntimeError(f"the followers failed ({followers.returncode}): {err[-2000:]}")
    finally:
        if followers.poll() is None:
            followers.kill()
            followers.communicate()
        jobs.close()
    return _following(json.loads(out), connect_seconds, rounds)


def _result(repeats: list[Following], *, tree: str | None) -> Result:
    followers = JOBS * FOLLOWERS_PER_JOB
    fields = [name for name, value in asdict(repeats[0]).items() if isinstance(value, int | float)]
    details: dict[str, Any] = {
        "jobs": JOBS,
        "followers_per_job": FOLLOWERS_PER_JOB,
        "rounds": ROUNDS,
        "round_seconds": ROUND_SECONDS,
        "events_per_batch": EVENTS_PER_BATCH,
        "client": "benchmarks/sse_followers.py, one process, raw HTTP/1.1",
        "auth": "keys on",
        **{name: asdict(Stat.of([float(getattr(r, name)) for r in repeats])) for name in fields},
        "round_p99_ms": [r.round_p99_ms for r in repeats],
    }
    return Result(
        id="B11b" if tree is None else f"B11b {tree}",
        title=f"SSE, {followers:,} followers of {JOBS} running jobs, keys on: event p99 from the line to the client"
        + ("" if tree is None else f", {tree}"),
        checks=[
            Check("SSE event p99", Stat.of([r.p99_ms for r in repeats]), "<=", TARGET_P99_MS, unit=" ms"),
            Check.reported("SSE event p50", Stat.of([r.p50_ms for r in repeats]), unit=" ms"),
        ],
        details=details,
    )


def measure_trees(trees: dict[str, Path], repeats: int) -> list[Result]:
    """Each tree ``repeats`` times, on a fresh deployment each, alternating which goes first."""
    measured: dict[str, list[Following]] = {name: [] for name in trees}
    for repeat in range(repeats):
        for name in list(trees) if repeat % 2 == 0 else list(reversed(trees)):
            with keyed_deployment(trees[name], owner=OWNER, name="b11b") as deployment:
                measured[name].append(measure(deployment))
            logger.info("B11b %s, repeat %d: %s", name, repeat, asdict(measured[name][-1]))
    alone = list(trees) == ["this checkout"]
    return [_result(figures, tree=None if alone else name) for name, figures in measured.items()]


def run(repeats: int) -> list[Result]:
    return measure_trees({"this checkout": REPO}, repeats)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import results

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH", help="a checkout to measure (default: this one)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default results/<date>.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    rows = measure_trees(trees_argument(parser, args.tree), args.repeats)
    path = results.write(rows, repeats=args.repeats, path=args.output)
    results.print_table(rows)
    results.Console().print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
