"""B11a: ``GET /jobs`` pages with 100,000 jobs in Postgres, one request at a time.

The table: ``JOBS`` jobs of one owner over a year (newest last), and ``OTHER_JOBS`` of each of
``OTHER_OWNERS`` between them, written with ``COPY`` after the migration (``job_rows``: a
deterministic mix of statuses, models and names, with the columns a finished job has filled),
then ``VACUUM ANALYZE``, as autovacuum leaves a table. The server is ``tuneq serve`` with keys
on (``benchmarks/keyed_deployment.py``); the owner's key is sent with every request.

Each page of ``CASES`` is asked ``REQUESTS`` times, one after another on one keep-alive
connection (``benchmarks/load.py --clients 1``, its own process), after ``WARMUP`` untimed
requests; the figure is the p99 of the timed ones, at the client. Cases a tree has no
parameter for (the filters and sort added after 2079b24) are measured on trees that have them.

``python -m benchmarks.b11_jobs_list --tree before=/tmp/b11-before --tree after=.`` measures
several checkouts side by side, alternating which goes first. On this checkout it also records
``EXPLAIN (ANALYZE, BUFFERS)`` of each case's statements (``api.jobs_service.list_jobs``'s own,
caught as they run) in the JSON's details.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx

from benchmarks.common import REPO, percentile
from benchmarks.keyed_deployment import KeyedDeployment, keyed_deployment, trees_argument
from benchmarks.results import Check, Result, Stat

logger = logging.getLogger(__name__)

OWNER = "bench"
JOBS = 100_000
OTHER_OWNERS = ("team-a", "team-b", "team-c")
OTHER_JOBS = 2_000  # each
SPAN = timedelta(days=365)  # the owner's jobs were created over this, evenly
REQUESTS = 300
WARMUP = 10
TARGET_P99_MS = 50.0
COPY_COLUMNS = (
    "id",
    "owner",
    "name",
    "status",
    "model",
    "dataset",
    "deepspeed_config",
    "resolved_deepspeed_config",
    "num_gpus",
    "training",
    "created_at",
    "started_at",
    "finished_at",
    "step",
    "total_steps",
    "latest_metrics",
    "tokens_seen",
    "attempts",
    "max_restarts",
    "events_offset",
    "log_offset",
    "error_code",
    "error_message",
    "queue",
)
# (status, share): most of a year's jobs have ended.
STATUS_SHARES = (
    ("succeeded", 0.70),
    ("failed", 0.12),
    ("cancelled", 0.08),
    ("running", 0.04),
    ("queued", 0.04),
    ("paused", 0.02),
)
MODELS = (
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.1-8B-Instruct",
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen2.5-7B-Instruct",
    "mistralai/Mistral-7B-v0.3",
    "google/gemma-2-2b",
    "EleutherAI/gpt-neo-1.3B",
    "/srv/models/gpt-neo-125m",
)
PROJECTS = ("sweep", "ablation", "baseline", "dpo", "sft", "eval-fix", "long-ctx", "tokenizer")


@dataclass(frozen=True)
class Case:
    """One page: its query parameters, and whether a tree before the filters can ask it."""

    name: str
    params: dict[str, str]
    before_filters: bool  # 2079b24's GET /jobs has it (status, skip, limit)


def cases(now: datetime) -> list[Case]:
    """The pages measured; ``now``: when the rows were written (created_after is 30 days before)."""
    return [
        Case("default first page", {}, True),
        Case("deep page, skip=50000", {"skip": "50000"}, True),
        Case("status=failed", {"status": "failed"}, True),
        Case("sort=name", {"sort": "name"}, False),
        Case("created_after, last 30 days", {"created_after": (now - timedelta(days=30)).isoformat()}, False),
        Case("model part-of 'llama'", {"model": "llama"}, False),
        Case("name part-of 'sweep-0421'", {"name": "sweep-0421"}, False),
    ]


def _status(draw: float) -> str:
    for status, share in STATUS_SHARES:
        if draw < share:
            return status
        draw -= share
    return STATUS_SHARES[0][0]


def job_rows(owner: str, count: int, *, now: datetime, seed: int) -> Iterator[tuple[Any, ...]]:
    """``count`` jobs of ``owner``, in ``COPY_COLUMNS`` order, created evenly over ``SPAN`` up to
    ``now`` (oldest first); the same rows for the same seed. Names are ``<project>-<n>``, ``n``
    the job's number (six digits); a job that ran has its resolved config, metrics and times."""
    rng = random.Random(seed)
    config = {
        "train_batch_size": 8,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8}},
    }
    resolved = {**config, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10}
    for n in range(count):
        status = _status(rng.random())
        created = now - SPAN * (count - n) / count
        ran = status not in ("queued",)
        ended = status in ("succeeded", "failed", "cancelled")
        total = rng.choice((500, 1000, 3000, 10000))
        step = total if status == "succeeded" else rng.randrange(total) if ran else 0
        metrics = {"loss": round(rng.uniform(0.5, 3.0), 4), "learning_rate": 2e-5, "tokens_per_second": 1800.0}
        yield (
            uuid.UUID(int=rng.getrandbits(128), version=4),
            owner,
            f"{rng.choice(PROJECTS)}-{n:06d}",
            status,
            rng.choice(MODELS),
            f"/srv/data/{rng.choice(PROJECTS)}/train.jsonl",
            json.dumps(config),
            json.dumps(resolved) if ran else None,
            rng.choice((1, 2, 4, 8)),
            json.dumps({"epochs": 1, "max_seq_length": 2048, "lora": None}),
            created,
            created + timedelta(minutes=1) if ran else None,
            created + timedelta(hours=2) if ended else None,
            step,
            total if ran else None,
            json.dumps({**metrics, "step": step}) if ran else None,
            step * 16_384,
            1 if ran else 0,
            2,
            step * 400,
            step * 120,
            "training_error" if status == "failed" else None,
            "CUDA out of memory at step 12" if status == "failed" else None,
            "tuneq-8gpu" if ran else None,
        )


def fill(database_url: str, *, jobs: int, now: datetime) -> None:
    """The owner's ``jobs`` and the other owners' rows, with ``COPY``, then ``VACUUM ANALYZE``."""
    import psycopg
    import sqlalchemy

    engine = sqlalchemy.create_engine(database_url)
    try:
        raw = engine.raw_connection()
        try:
            driver = raw.driver_connection
            assert isinstance(driver, psycopg.Connection)
            statement = f"COPY jobs ({', '.join(COPY_COLUMNS)}) FROM STDIN"
            with driver.cursor() as cursor, cursor.copy(statement) as copy:
                for seed, (owner, count) in enumerate([(OWNER, jobs), *((o, OTHER_JOBS) for o in OTHER_OWNERS)]):
                    for row in job_rows(owner, count, now=now, seed=seed):
                        copy.write_row(row)
            raw.commit()
        finally:
            raw.close()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE jobs")
    finally:
        engine.dispose()


@dataclass
class Page:
    """One case's figures on one deployment."""

    p50_ms: float
    p99_ms: float
    max_ms: float
    count: int  # what the page's ``count`` said: how many jobs match
    rows: int  # jobs on the page
    load_average: float  # 1-minute, at its end


def _measure_case(deployment: KeyedDeployment, case: Case) -> Page:
    query = f"?{urlencode(case.params)}" if case.params else ""
    url = f"{deployment.server.base_url}/jobs{query}"
    answer = httpx.get(url, headers={"Authorization": f"Bearer {deployment.key}"}, timeout=60).raise_for_status()
    body = answer.json()
    argv = [sys.executable, "-m", "benchmarks.load", url, "--clients", "1", "--requests", str(REQUESTS)]
    argv += ["--warmup", str(WARMUP), "--header", deployment.authorization]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed on {case.name}: {done.stderr[-2000:]}")
    latencies = [s * 1000 for s in json.loads(done.stdout)["latencies"]]
    return Page(
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        max_ms=max(latencies),
        count=int(body["count"]),
        rows=len(body["data"]),
        load_average=os.getloadavg()[0],
    )


def _list_query(case: Case) -> Any:
    """The ``api.jobs_service.JobListQuery`` that ``GET /jobs`` makes of the case's parameters."""
    from api.jobs_service import JobListQuery
    from shared.jobs.status import JobStatus

    params = case.params
    sort = params.get("sort", "-created_at")
    return JobListQuery(
        status=JobStatus(params["status"]) if "status" in params else None,
        model=params.get("model"),
        name=params.get("name"),
        created_after=datetime.fromisoformat(params["created_after"]) if "created_after" in params else None,
        sort=sort.removeprefix("-"),
        descending=sort.startswith("-"),
        skip=int(params.get("skip", 0)),
    )


def query_plans(database_url: str, pages: Sequence[Case]) -> dict[str, list[str]]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of the statements this checkout's ``list_jobs`` runs for
    each case (the count, then the page), caught as they run."""
    import sqlalchemy
    from sqlalchemy import event
    from sqlmodel import Session

    from api.jobs_service import list_jobs

    engine = sqlalchemy.create_engine(database_url)
    caught: list[tuple[str, Any]] = []

    def catch(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        caught.append((statement, parameters))

    plans: dict[str, list[str]] = {}
    try:
        for case in pages:
            caught.clear()
            event.listen(engine, "before_cursor_execute", catch)
            try:
                with Session(engine) as session:
                    list_jobs(session=session, owner=OWNER, query=_list_query(case))
            finally:
                event.remove(engine, "before_cursor_execute", catch)
            with engine.connect() as conn:
                plans[case.name] = [
                    "\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {sql}", parameters))
                    for sql, parameters in caught
                ]
    finally:
        engine.dispose()
    return plans


def measure(deployment: KeyedDeployment, pages: Sequence[Case]) -> dict[str, Page]:
    measured = {}
    for case in pages:
        measured[case.name] = _measure_case(deployment, case)
        logger.info("B11a %s: %s", case.name, asdict(measured[case.name]))
    return measured


def _result(
    measured: dict[str, list[Page]], *, tree: str | None, jobs: int, plans: dict[str, list[str]] | None
) -> Result:
    """One tree's row (``B11a``, or ``B11a <tree>`` beside others)."""
    checks = [
        Check(f"{name} p99", Stat.of([p.p99_ms for p in pages]), "<=", TARGET_P99_MS, unit=" ms")
        for name, pages in measured.items()
    ]
    details: dict[str, Any] = {
        "jobs_of_the_owner": jobs,
        "other_owners": {owner: OTHER_JOBS for owner in OTHER_OWNERS},
        "requests_per_case": REQUESTS,
        "warmup_per_case": WARMUP,
        "client": "benchmarks/load.py, 1 connection, sequential",
        "auth": "keys on",
        "cases": {
            name: {
                field: asdict(Stat.of([float(getattr(p, field)) for p in pages]))
                for field in ("p50_ms", "p99_ms", "max_ms", "load_average")
            }
            | {"count": pages[0].count, "rows": pages[0].rows}
            for name, pages in measured.items()
        },
    }
    if plans:
        details["plans"] = plans
    return Result(
        id="B11a" if tree is None else f"B11a {tree}",
        title=f"GET /jobs pages, {jobs:,} jobs of one owner in Postgres, keys on, sequential: p99 per page"
        + ("" if tree is None else f", {tree}"),
        checks=checks,
        details=details,
    )


def measure_trees(trees: dict[str, Path], repeats: int, *, jobs: int = JOBS) -> list[Result]:
    """Each tree ``repeats`` times, on a fresh deployment each, alternating which goes first."""
    measured: dict[str, dict[str, list[Page]]] = {name: {} for name in trees}
    plans: dict[str, dict[str, list[str]]] = {}
    for repeat in range(repeats):
        for name in list(trees) if repeat % 2 == 0 else list(reversed(trees)):
            now = datetime.now(UTC)
            tree_has_filters = "JobListQuery" in (trees[name] / "api" / "jobs_service.py").read_text()
            pages = [c for c in cases(now) if tree_has_filters or c.before_filters]
            rows = functools.partial(fill, jobs=jobs, now=now)
            with keyed_deployment(trees[name], owner=OWNER, name="b11a", fill=rows) as deployment:
                for case_name, page in measure(deployment, pages).items():
                    measured[name].setdefault(case_name, []).append(page)
                if trees[name] == REPO and name not in plans:
                    plans[name] = query_plans(deployment.database_url, pages)
    return [
        _result(pages, tree=None if list(trees) == ["this checkout"] else name, jobs=jobs, plans=plans.get(name))
        for name, pages in measured.items()
    ]


def run(repeats: int) -> list[Result]:
    return measure_trees({"this checkout": REPO}, repeats)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import results

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH", help="a checkout to measure (default: this one)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=JOBS, help=f"the owner's jobs ({JOBS:,})")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default results/<date>.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    rows = measure_trees(trees_argument(parser, args.tree), args.repeats, jobs=args.jobs)
    path = results.write(rows, repeats=args.repeats, path=args.output)
    results.print_table(rows)
    results.Console().print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
