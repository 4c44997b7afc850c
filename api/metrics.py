"""Prometheus metrics for ``GET /metrics``: what the database says now, and how the API answers.

Job and worker figures are read from SQL at scrape time (one collector, a few small queries),
not counted in this process: the database is the one place job state lives, so every API
replica reports the same numbers and a restart loses nothing. Request latency is the one
figure only the API's processes know; it is kept in a histogram per route template. Where
``tuneq serve`` runs several processes (``api.server_processes``), each keeps its histogram in
a file of ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode), and a scrape,
whichever process answers it, sums them all.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import func
from sqlmodel import Session, col, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.db.engine import get_engine
from shared.db.gangs import gangs_waiting
from shared.db.lifecycle import live_since, live_worker, running_worker
from shared.db.models import Job, JobMetric, Worker
from shared.jobs.status import JobStatus
from shared.settings import get_settings

logger = logging.getLogger(__name__)

# Steps per second of a running job: over its last this-many recorded steps, so the figure
# follows the job's current pace rather than its average since start-up.
RATE_WINDOW_STEPS = 20


def _steps_per_second(session: Session, job_id: uuid.UUID) -> float | None:
    rows = session.exec(
        select(JobMetric.step, JobMetric.time)
        .where(col(JobMetric.job_id) == job_id)
        .order_by(col(JobMetric.step).desc())
        .limit(RATE_WINDOW_STEPS)
    ).all()
    if len(rows) < 2:
        return None
    (last_step, last_time), (first_step, first_time) = rows[0], rows[-1]
    seconds = (last_time - first_time).total_seconds()
    return (last_step - first_step) / seconds if seconds > 0 else None


class JobStateCollector(Collector):
    """Jobs by status, the queue's depth, gangs waiting, live workers and each running job's pace, from SQL."""

    def describe(self) -> Iterator[Metric]:
        # What registering asks for: the names only, without reading the database (an app is
        # often built before its database is there, e.g. to render /openapi.json).
        return iter(self._families().values())

    def _families(self) -> dict[str, GaugeMetricFamily]:
        return {
            "up": GaugeMetricFamily("tuneq_database_up", "Whether the last scrape could read the database."),
            "jobs": GaugeMetricFamily("tuneq_jobs", "Jobs by status.", labels=["status"]),
            "queued": GaugeMetricFamily(
                "tuneq_queue_depth",
                'Jobs submitted and not yet claimed, by the queue they were published to ("" before any).',
                labels=["queue"],
            ),
            "gangs": GaugeMetricFamily(
                "tuneq_gangs_waiting",
                "Multi-node jobs queued for want of enough idle workers (placed, never published: also in "
                'tuneq_queue_depth{queue=""}).',
            ),
            "workers": GaugeMetricFamily(
                "tuneq_workers", "Live workers: seen within TUNEQ_WORKER_SEEN_SECONDS, not stopped, taking jobs."
            ),
            "unavailable": GaugeMetricFamily(
                "tuneq_workers_unavailable",
                "Workers seen and not stopped that take no job now (a full disk), by worker, with the reason.",
                labels=["worker", "reason"],
            ),
            "pace": GaugeMetricFamily(
                "tuneq_job_steps_per_second", "Optimizer steps per second of each running job.", labels=["job_id"]
            ),
        }

    def collect(self) -> Iterator[Metric]:
        f = self._families()
        try:
            with Session(get_engine()) as session:
                counts = dict(session.exec(select(Job.status, func.count()).group_by(Job.status)).all())
                for status in JobStatus:
                    f["jobs"].add_metric([status.value], counts.get(status, 0))
                waiting = session.exec(
                    select(Job.queue, func.count()).where(col(Job.status) == JobStatus.queued).group_by(Job.queue)
                ).all()
                for queue, count in waiting:
                    f["queued"].add_metric([queue or ""], count)
                f["gangs"].add_metric([], gangs_waiting(session=session))
                since = live_since(get_settings())
                seen = session.exec(select(func.count()).select_from(Worker).where(live_worker(since)))
                f["workers"].add_metric([], seen.one())
                unavailable = session.exec(
                    select(Worker.id, Worker.unavailable).where(
                        running_worker(since), col(Worker.unavailable).is_not(None)
                    )
                ).all()
                for worker_id, reason in unavailable:
                    f["unavailable"].add_metric([worker_id, reason or ""], 1)
                running = session.exec(select(Job.id).where(col(Job.status) == JobStatus.running)).all()
                for job_id in running:
                    rate = _steps_per_second(session, job_id)
                    if rate is not None:
                        f["pace"].add_metric([str(job_id)], rate)
        except Exception:
            # A scrape must still answer (and say the database is down) rather than fail.
            logger.exception("could not read job state for /metrics")
            f["up"].add_metric([], 0)
            yield f["up"]
            return
        f["up"].add_metric([], 1)
        yield from f.values()


# Set by `tuneq serve` for its processes (api.server_processes) before any of them imports
# prometheus_client, which then keeps every metric's values in files there.
METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


def build_registry() -> tuple[CollectorRegistry, Histogram]:
    """The registry ``/metrics`` exposes, and the latency histogram requests are observed in.
    In multiprocess mode the registry reads every process's histogram from its file instead of
    this one's (which is then registered nowhere, or a scrape would count it twice)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(JobStateCollector())
    shared_dir = os.environ.get(METRICS_DIR_VARIABLE)
    latency = Histogram(
        "tuneq_http_request_duration_seconds",
        "Time from request to response headers, by route template, method and status.",
        labelnames=["method", "route", "status"],
        registry=None if shared_dir else registry,
        # Reads answer in milliseconds; a submit waits on the database and the broker.
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    )
    if shared_dir:
        MultiProcessCollector(registry, path=shared_dir)
    return registry, latency


def _route_template(scope: Scope) -> str:
    # The template ("/jobs/{job_id}"), never the raw path: one series per route, not per job.
    # The router records the route it matched in the (shared) scope.
    return str(getattr(scope.get("route"), "path", "unmatched"))


class RequestLatency:
    """ASGI middleware: observes each HTTP request's time to its response headers.

    Pure ASGI rather than ``BaseHTTPMiddleware``, which would wrap event streams; for a
    stream the time to its headers is the latency a client feels.
    """

    def __init__(self, app: ASGIApp, *, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        observed = False

        def observe(status: int) -> None:
            nonlocal observed
            if not observed:
                observed = True
                route = _route_template(scope)
                self.histogram.labels(scope["method"], route, str(status)).observe(time.perf_counter() - start)

        async def send_timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                observe(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        except Exception:
            observe(500)
            raise


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST
