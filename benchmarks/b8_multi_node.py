"""B8: multi-node jobs (issue 23): a 2-node x 1-rank job against the same world size on one node.

One cluster for every run, as the multi-node end-to-end tests start it
(``tests.e2e.harness.start_cluster``): one ``tuneq serve`` and ``WORKERS`` ``tuneq worker``s,
each on a home of its own (another "host": no shared disk, its own tokenized cache and warm
start), all advertising 127.0.0.1, on a fresh Postgres schema, Redis (``benchmarks.common``)
and moto's S3 server in its own process as the artifact store (``b7_artifacts.moto_s3``: the
nodes share no disk, so a gang's checkpoint shards meet in the store).

Both sides are B1's job (``benchmarks/workload.py``: model, data, DeepSpeed config, seed,
``STEPS`` steps, one metric a step) with world size ``workload.RANKS`` (2): ``num_nodes`` 2 x
``num_gpus`` 1 (one rank on each worker, meeting at node 0's rendezvous port) and ``num_nodes``
1 x ``num_gpus`` 2 (both ranks on one worker). Each repeat runs both, alternating which goes
first; before each submit the benchmark waits until both workers are registered idle, so the
gang is placed at once. A 2-node and a 1-node job of ``STARTUP_STEPS`` steps run first, not
timed: each worker's tokenized cache is filled and its warm start used once (B3's warm service).

Steps/s: as B1, from the metrics' times over the steps after ``WARMUP_STEPS``; the figure is
2-node ÷ 1-node steps/s (target ≥ 0.95). On one host both sides' ranks are two processes of
this machine talking over loopback TCP (gloo's all-reduce; DeepSpeed's shared-memory all-reduce
serves only its inference path), so the ratio is the coordination overhead of a gang: node 1's
own worker (ingesting its log, renewing its node), the second rendezvous, the ranks' placement.
A CPU worker counts its cores as its devices, so each worker here has ``os.cpu_count()``, and
tuneq's launcher gives each rank ``OMP_NUM_THREADS`` = devices ÷ ranks on its node: 1 thread
for each of the 1-node job's 2 ranks, 2 for each of the 2-node job's (one per worker), so the
2-node job runs 4 threads on 2 cores. The cluster's environment sets no ``OMP_NUM_THREADS``
(tuneq's defaults apply); the details record the counts, computed with the launcher's own
``rank_environment``.

Start-up: as B3, from just before ``POST /jobs`` to the first metric's ``time`` (same host
clock), split by the job's events into placement/claim, the ranks' start-up to rank 0's plan
event, and engine + step 1 (``b3_startup.start_phases``); the figure is 2-node ÷ 1-node,
reported without a target.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import workload
from benchmarks.b1_training import STEPS, WARMUP_STEPS, steps_per_second
from benchmarks.b3_startup import start_phases
from benchmarks.b7_artifacts import BUCKET, moto_s3, s3_credentials
from benchmarks.common import REDIS_URL, drop_schema, fresh_postgres_schema, keep_log
from benchmarks.results import Check, Result, Stat
from benchmarks.training_runs import alternate, metric_times
from shared.jobs.hardware import Hardware
from worker import launcher

if TYPE_CHECKING:
    from tests.e2e.harness import Tuneq

logger = logging.getLogger(__name__)

WORKERS = 2
STARTUP_STEPS = 2  # the warm-up jobs: B3's
JOB_TIMEOUT_SECONDS = 1800
STORE_PREFIX = "b8"


@dataclass
class Run:
    steps_per_second: float
    window_seconds: float  # the timed steps' wall-clock time
    startup_seconds: float  # submit → the first metric's time
    phases: dict[str, float]
    nodes: list[dict[str, Any]]  # the gang's nodes (worker, ranks); empty for a one-node job
    load_average: float  # the host's 1-minute load average at submit (it is shared)


def job_body(work: Path, *, name: str, num_nodes: int, max_steps: int = STEPS) -> dict[str, Any]:
    """B1's job with its ``workload.RANKS`` ranks spread over ``num_nodes`` nodes: the same world
    size, so the same batches, steps and DeepSpeed config."""
    if workload.RANKS % num_nodes:
        raise ValueError(f"{workload.RANKS} ranks do not split over {num_nodes} nodes")
    body = workload.job_body(work, name=name, max_steps=max_steps, log_every_steps=1)
    return {**body, "num_gpus": workload.RANKS // num_nodes, "num_nodes": num_nodes}


def omp_threads(hardware: Hardware, *, ranks_per_node: int) -> int | None:
    """The ``OMP_NUM_THREADS`` tuneq's launcher gives each of a node's ``ranks_per_node`` ranks
    on ``hardware`` (None where it sets none: a GPU host)."""
    threads = launcher.rank_environment(hardware, num_ranks=ranks_per_node, worker_pid=0).get("OMP_NUM_THREADS")
    return int(threads) if threads is not None else None


def store_env(endpoint: str) -> dict[str, str]:
    """The cluster's artifact store: ``s3://BUCKET/STORE_PREFIX`` on the moto server at
    ``endpoint`` (as ``tests.e2e.conftest.s3_artifacts_env`` gives a test's)."""
    return {
        **s3_credentials(),
        "TUNEQ_S3_ENDPOINT_URL": endpoint,
        "TUNEQ_ARTIFACTS_URI": f"s3://{BUCKET}/{STORE_PREFIX}",
    }


def _run_job(cluster: Tuneq, database: str, body: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """Submit once every worker is idle; wait for success: the job id, the submit time and the job."""
    from tests.e2e.harness import wait_for_workers

    wait_for_workers(cluster, database, WORKERS)
    submitted = time.time()
    response = cluster.client.post("/jobs", json=body)
    if response.status_code != 201:
        raise RuntimeError(f"POST /jobs answered {response.status_code}: {response.text}")
    job_id = str(response.json()["id"])
    job = cluster.wait(job_id, timeout=JOB_TIMEOUT_SECONDS)
    if job["status"] != "succeeded":
        kept = keep_log(cluster.log, "b8-cluster")
        raise RuntimeError(f"tuneq job {job_id} {job['status']}: {job.get('error')} (log: {kept})")
    return job_id, submitted, job


def _timed_run(cluster: Tuneq, database: str, work: Path, *, num_nodes: int, repeat: int) -> Run:
    body = job_body(work, name=f"b8-{num_nodes}-node-{repeat}", num_nodes=num_nodes)
    load = os.getloadavg()[0]
    job_id, submitted, job = _run_job(cluster, database, body)
    metrics = cluster.get(f"/jobs/{job_id}/metrics")["data"]
    times = metric_times(metrics)
    speed = steps_per_second(times)
    run = Run(
        steps_per_second=speed,
        window_seconds=(STEPS - WARMUP_STEPS) / speed,
        startup_seconds=times[0] - submitted,
        phases=start_phases(cluster.client, job_id, submitted, times[0]),
        nodes=[{"node_rank": n["node_rank"], "worker_id": n["worker_id"], "ranks": n["ranks"]} for n in job["nodes"]],
        load_average=load,
    )
    logger.info("B8 %d-node %d: %s", num_nodes, repeat, run)
    return run


def _median_phases(runs: list[Run]) -> dict[str, float]:
    names = sorted({name for r in runs for name in r.phases})
    return {name: statistics.median(r.phases[name] for r in runs if name in r.phases) for name in names}


def run(repeats: int) -> list[Result]:
    from tests.e2e.harness import start_cluster

    hardware = launcher.detect_hardware()
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-b8-") as tmp:
        work = Path(tmp)
        workload.prepare(work)  # model, data, config, the op built; the ranks' environment is tuneq's own
        database = fresh_postgres_schema()
        try:
            with moto_s3(work) as moto:
                cluster = start_cluster(
                    work / "cluster",
                    work,
                    database=database,
                    broker=REDIS_URL,
                    store=store_env(moto.base_url),
                    hosts=WORKERS,
                )
                try:
                    for num_nodes in (WORKERS, 1):  # warm-up, not timed
                        body = job_body(
                            work, name=f"b8-warm-up-{num_nodes}", num_nodes=num_nodes, max_steps=STARTUP_STEPS
                        )
                        _run_job(cluster, database, body)
                    multi, single = alternate(
                        repeats,
                        lambda r: _timed_run(cluster, database, work, num_nodes=WORKERS, repeat=r),
                        lambda r: _timed_run(cluster, database, work, num_nodes=1, repeat=r),
                    )
                except Exception:
                    keep_log(cluster.log, "b8-cluster")
                    raise
                finally:
                    cluster.stop()
        finally:
            drop_schema(database)
    speed = [m.steps_per_second / s.steps_per_second for m, s in zip(multi, single, strict=True)]
    startup = [m.startup_seconds / s.startup_seconds for m, s in zip(multi, single, strict=True)]
    return [
        Result(
            id="B8",
            title=f"{WORKERS}-node x 1-rank job ÷ 1-node x {workload.RANKS}-rank job, same cluster: steps/s, start-up",
            checks=[
                Check(f"steps/s ratio, {WORKERS} nodes ÷ 1 node", Stat.of(speed), ">=", 0.95),
                Check.reported(f"submit → first step, {WORKERS} nodes ÷ 1 node", Stat.of(startup)),
            ],
            details={
                "cluster": f"tuneq serve + {WORKERS} tuneq workers (own homes, 127.0.0.1), Postgres, Redis, "
                "moto S3 in its own process",
                "world_size": workload.RANKS,
                "steps": STEPS,
                "warmup_steps": WARMUP_STEPS,
                "worker_devices": hardware.device_count,
                "worker_accelerator": hardware.accelerator,
                "omp_threads_per_rank": {
                    f"{WORKERS} nodes x {workload.RANKS // WORKERS} rank": omp_threads(
                        hardware, ranks_per_node=workload.RANKS // WORKERS
                    ),
                    f"1 node x {workload.RANKS} ranks": omp_threads(hardware, ranks_per_node=workload.RANKS),
                },
                "omp_num_threads_set": os.environ.get("OMP_NUM_THREADS"),
                "multi_node_steps_per_second": Stat.of([r.steps_per_second for r in multi]).__dict__,
                "single_node_steps_per_second": Stat.of([r.steps_per_second for r in single]).__dict__,
                "multi_node_window_seconds": [r.window_seconds for r in multi],
                "single_node_window_seconds": [r.window_seconds for r in single],
                "multi_node_startup_seconds": Stat.of([r.startup_seconds for r in multi]).__dict__,
                "single_node_startup_seconds": Stat.of([r.startup_seconds for r in single]).__dict__,
                "multi_node_phases_median_seconds": _median_phases(multi),
                "single_node_phases_median_seconds": _median_phases(single),
                "multi_node_placements": [r.nodes for r in multi],
                "multi_node_load_average": [r.load_average for r in multi],
                "single_node_load_average": [r.load_average for r in single],
            },
        )
    ]
