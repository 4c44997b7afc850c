"""B9: ``tuneq serve`` under load with API keys on, on Postgres and Redis, measured with ``wrk``.

Two loads, as issue 41's probe ran them: (a) 300 ``POST /jobs`` from 30 connections, each with
its own ``Idempotency-Key``; (b) ``GET /jobs/{id}`` from 500 connections for 10 s, over the ids
of the jobs (a) made, in turn (500 pollers of 300 jobs). Each request carries a key made by
``tuneq keys create``. The figures are wrk's: p50/p95/p99 and requests per second, timed at the
client.

The generator is ``wrk`` (C, one thread, epoll), pinned to one of the host's cores; the API is
not pinned, so on a 2-core host the two share a core as in the probe. What each side costs is
measured, not assumed: wrk's CPU time (its rusage), the API process's (and its children's), and
that of the Postgres backends serving the API's connections, per request. ``wrk`` is a system
package (``apt-get install -y wrk``); the benchmark refuses to start without it.

Each repeat runs on a fresh deployment: a new Postgres schema migrated with ``tuneq migrate``, a
live CPU worker's row (so submits are routed and published to Redis, as in a deployment with
workers; no worker runs, so the jobs stay queued), a key, and ``tuneq serve`` with
``TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER`` 1000 (the default 8 would answer most submits 429) on a
queue of its own. 10 submits warm the server up first, untimed.

``python -m benchmarks.b9_load --tree before=/tmp/tuneq-before --tree after=.`` measures
several checkouts side by side with this benchmark's code, alternating which goes first, each
server run from its tree (``cwd`` and ``PYTHONPATH``, with this interpreter's packages);
``--profile DIR`` also records each API process with py-spy (``pip install py-spy``) during
each load, as collapsed stacks; profiled runs cost the host CPU, so their figures are not the
reported ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import REDIS_URL, REPO, Server, drop_schema, fresh_postgres_schema, migrate, tuneq_env
from benchmarks.keyed_deployment import trees_argument
from benchmarks.results import Check, Result, Stat
from shared.ports import free_port

logger = logging.getLogger(__name__)

SUBMITS = 300
SUBMIT_CONNECTIONS = 30
WARMUP_SUBMITS = 10
POLL_CONNECTIONS = 500
POLL_SECONDS = 10
TARGET_P99_MS = 250.0
OWNER = "bench"
# Submits past the default TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER (8) would be 429s; the limit stays
# on, so each submit still takes its owner's lock and counts the owner's active jobs.
ACTIVE_JOBS_LIMIT = 1000
WRK_SCRIPT = Path(__file__).with_name("b9_wrk.lua")
# wrk counts a slower answer as a timeout, left out of its histogram; a run with any fails.
WRK_TIMEOUT = "60s"
WRK_INSTALL = "B9 needs wrk, the HTTP load generator: `apt-get install -y wrk` (Debian, Ubuntu) or `brew install wrk`"


def require_wrk() -> str:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError(WRK_INSTALL)
    return wrk


def generator_core() -> int:
    """The core wrk is pinned to: the last this process may use."""
    return max(os.sched_getaffinity(0))


@dataclass
class Phase:
    """One load's figures: wrk's and the CPU each side used during it."""

    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    errors: dict[str, int]
    generator_cpu_ms_per_request: float
    api_cpu_ms_per_request: float
    postgres_cpu_ms_per_request: float
    host_busy_share: float  # of all the host's cores, over the phase
    load_average: float  # 1-minute, at its end


class CpuMeter:
    """CPU seconds of the API's processes, of the Postgres backends serving its connections,
    and of the whole host, between ``start`` and ``stop``."""

    def __init__(self, server: Server) -> None:
        import psutil

        self._psutil = psutil
        self._server = server
        self._api = psutil.Process(server.process.pid)

    def _postgres_backends(self) -> dict[int, float]:
        """Every Postgres process's CPU seconds, by pid."""
        seconds = {}
        for process in self._psutil.process_iter(["name", "cpu_times"]):
            if process.info["name"] == "postgres" and process.info["cpu_times"] is not None:
                seconds[process.pid] = process.info["cpu_times"].user + process.info["cpu_times"].system
        return seconds

    def _served_backends(self) -> set[int]:
        """The Postgres backends whose client is one of the API's connections: their process
        title names the client's address, ``postgres: user db 127.0.0.1(PORT) idle``."""
        ports = set()
        for process in [self._api, *self._api.children(recursive=True)]:
            with contextlib.suppress(self._psutil.NoSuchProcess):
                ports |= {c.laddr.port for c in process.net_connections("tcp") if c.raddr and c.raddr.port == 5432}
        served = set()
        for process in self._psutil.process_iter(["name", "cmdline"]):
            title = " ".join(process.info["cmdline"] or ())
            if process.info["name"] == "postgres" and any(f"({port})" in title for port in ports):
                served.add(process.pid)
        return served

    def start(self) -> None:
        self._api_start = self._server.cpu_seconds()
        self._postgres_start = self._postgres_backends()
        self._host_start = self._psutil.cpu_times()
        self._started = time.monotonic()

    def stop(self) -> tuple[float, float, float]:
        """API seconds, Postgres seconds, and the share of the host's cores that were busy."""
        wall = time.monotonic() - self._started
        host = self._psutil.cpu_times()
        idle = (host.idle + host.iowait) - (self._host_start.idle + self._host_start.iowait)
        busy_share = 1 - idle / (wall * (os.cpu_count() or 1))
        postgres_now = self._postgres_backends()
        postgres = sum(postgres_now[pid] - self._postgres_start.get(pid, 0.0) for pid in self._served_backends())
        return self._server.cpu_seconds() - self._api_start, postgres, busy_share


@dataclass
class Deployment:
    server: Server
    key: str
    home: Path
    tree: Path


def _run_cli(tree: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", *args], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"tuneq {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def _add_live_worker(database_url: str, queue: str) -> None:
    """A live CPU worker's row (2 devices), so the API routes each submit to its size's queue
    and publishes it to Redis. Plain SQL: the columns every tree's schema has."""
    import sqlalchemy
    from sqlalchemy import text

    engine = sqlalchemy.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO workers (id, hostname, accelerator, device_count, device_memory_bytes, bf16_supported,"
                " queue, started_at, last_seen_at) VALUES ('bench-worker', 'bench', 'cpu', 2, :memory, false,"
                " :queue, now(), now())"
            ),
            {"memory": 16 * 2**30, "queue": queue},
        )
    engine.dispose()


def _drop_queue(queue_prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for name in client.scan_iter(match=f"*{queue_prefix}*"):
        client.delete(name)
    client.close()


def _job_body(data: Path) -> Path:
    """A valid job over a tiny local model and dataset (what submit checks: the model's config
    and weights, every dataset record, the DeepSpeed config)."""
    from cli.samples import build_tiny_model, seed_config, write_text_dataset

    model = data / "model"
    if not model.exists():
        build_tiny_model(model)
    dataset = write_text_dataset(data / "train.jsonl")
    body = data / "job.json"
    body.write_text(
        json.dumps({"model": str(model), "dataset": str(dataset), "deepspeed_config": seed_config(fp16=False)})
    )
    return body


@contextlib.contextmanager
def deployment(tree: Path, models: Path) -> Iterator[Deployment]:
    """``tuneq serve`` from ``tree`` with keys on, on a fresh schema, with a live worker's row."""
    database_url = fresh_postgres_schema()
    queue = f"bench-{uuid.uuid4().hex[:10]}"
    try:
        with tempfile.TemporaryDirectory(prefix="tuneq-bench-b9-") as tmp:
            home = Path(tmp)
            (home / "data").symlink_to(models)  # the default allowed root, TUNEQ_HOME/data
            env = {
                **tuneq_env(home=home, database_url=database_url),
                "TUNEQ_AUTH": "on",
                "TUNEQ_QUEUE": queue,
                "TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER": str(ACTIVE_JOBS_LIMIT),
                "PYTHONPATH": str(tree),
            }
            log = home / "serve.log"
            migrate(env, log, cwd=tree)
            _add_live_worker(database_url, f"{queue}-2gpu")
            key = _run_cli(tree, env, "keys", "create", "--owner", OWNER).strip()
            port = free_port()
            argv = [sys.executable, "-m", "cli.main", "serve", "--port", str(port)]
            with Server(argv, env=env, log=log, port=port, cwd=tree) as server:
                server.wait_ready("/readyz")
                server.wait_idle()
                yield Deployment(server=server, key=key, home=home, tree=tree)
    finally:
        drop_schema(database_url)
        _drop_queue(queue)


def _wrk(url: str, *, connections: int, seconds: int, script_args: Sequence[str]) -> dict[str, Any]:
    """Run wrk, pinned to the generator's core: the figures its script prints."""
    argv = [
        require_wrk(),
        "--threads",
        "1",
        "--connections",
        str(connections),
        "--duration",
        f"{seconds}s",
        "--timeout",
        WRK_TIMEOUT,
        "--script",
        str(WRK_SCRIPT),
        url,
        "--",
        *script_args,
    ]
    core = generator_core()
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    out, err = process.communicate(timeout=seconds + 120)
    if process.returncode != 0:
        raise RuntimeError(f"wrk failed ({process.returncode}): {err[-2000:]}")
    lines = [line for line in out.splitlines() if line.startswith("B9 {")]
    if not lines:
        raise RuntimeError(f"wrk printed no figures: {out[-2000:]} {err[-2000:]}")
    figures = json.loads(lines[-1][3:])
    if err.strip():
        figures["stderr"] = err[-2000:]
    return figures


@contextlib.contextmanager
def _profiled(pid: int, output: Path | None) -> Iterator[None]:
    """py-spy record of ``pid`` and its children while the block runs, as collapsed stacks
    (``TUNEQ_BENCH_PY_SPY_ARGS``: more of py-spy's options, e.g. ``--gil --nonblocking``)."""
    if output is None:
        yield
        return
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise RuntimeError("--profile needs py-spy: pip install py-spy")
    extra = os.environ.get("TUNEQ_BENCH_PY_SPY_ARGS", "").split()
    argv = [py_spy, "record", "--pid", str(pid), "--subprocesses", "--format", "raw", *extra]
    recorder = subprocess.Popen(
        [*argv, "--output", str(output)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    time.sleep(1.0)  # attached before the load starts
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.communicate(timeout=60)


def _load_phase(
    deployment: Deployment, *, connections: int, seconds: int, script_args: Sequence[str], profile: Path | None
) -> Phase:
    import resource

    meter = CpuMeter(deployment.server)
    with _profiled(deployment.server.process.pid, profile):
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        meter.start()
        figures = _wrk(deployment.server.base_url, connections=connections, seconds=seconds, script_args=script_args)
        api, postgres, busy = meter.stop()
        children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The only child reaped between the two readings is wrk (py-spy ends after them).
    generator = (children_after.ru_utime + children_after.ru_stime) - (
        children_before.ru_utime + children_before.ru_stime
    )
    requests = int(figures["requests"])
    errors = {**figures["errors"], "unexpected": figures["unexpected"]}
    if any(errors.values()):
        raise RuntimeError(f"wrk saw errors: {errors} {figures.get('stderr', '')}")
    return Phase(
        requests=requests,
        seconds=figures["seconds"],
        rps=requests / figures["seconds"],
        p50_ms=figures["p50_us"] / 1000,
        p95_ms=figures["p95_us"] / 1000,
        p99_ms=figures["p99_us"] / 1000,
        max_ms=figures["max_us"] / 1000,
        errors=errors,
        generator_cpu_ms_per_request=generator * 1000 / requests,
        api_cpu_ms_per_request=api * 1000 / requests,
        postgres_cpu_ms_per_request=postgres * 1000 / requests,
        host_busy_share=busy,
        load_average=os.getloadavg()[0],
    )


def _warm_up(deployment: Deployment, body: Path) -> None:
    """A few submits and reads before the clock: the server's first ones open its connections
    to Postgres and Redis; a server in service has done that long before."""
    headers = {"Authorization": f"Bearer {deployment.key}"}
    with httpx.Client(base_url=deployment.server.base_url, headers=headers, timeout=60) as client:
        for _ in range(WARMUP_SUBMITS):
            answer = client.post("/jobs", content=body.read_bytes(), headers={"Content-Type": "application/json"})
            if answer.status_code != 201:
                raise RuntimeError(f"a warm-up submit answered {answer.status_code}: {answer.text[:500]}")
            client.get(f"/jobs/{answer.json()['id']}").raise_for_status()


def _job_ids(deployment: Deployment, path: Path) -> int:
    """Write the ids of the owner's newest jobs (those the timed submits made), one a line."""
    headers = {"Authorization": f"Bearer {deployment.key}"}
    answer = httpx.get(
        f"{deployment.server.base_url}/jobs", params={"limit": SUBMITS}, headers=headers, timeout=60
    ).raise_for_status()
    ids = [job["id"] for job in answer.json()["data"]]
    path.write_text("".join(f"{i}\n" for i in ids))
    return len(ids)


def measure(deployment: Deployment, body: Path, *, profile: Path | None = None) -> dict[str, Phase]:
    """(a) the submits, then (b) the reads of the jobs they made, on one deployment."""
    _warm_up(deployment, body)
    submit = _load_phase(
        deployment,
        connections=SUBMIT_CONNECTIONS,
        seconds=600,  # a cap: wrk stops itself after SUBMITS answers
        script_args=["post", deployment.key, str(SUBMITS), str(body), f"bench-{uuid.uuid4().hex[:8]}-"],
        profile=profile and profile.with_name(profile.name + "-submit.txt"),
    )
    ids = deployment.home / "job-ids.txt"
    if _job_ids(deployment, ids) < SUBMITS:
        raise RuntimeError("fewer jobs than submits were found")
    poll = _load_phase(
        deployment,
        connections=POLL_CONNECTIONS,
        seconds=POLL_SECONDS,
        script_args=["get", deployment.key, str(ids)],
        profile=profile and profile.with_name(profile.name + "-poll.txt"),
    )
    return {"submit": submit, "poll": poll}


def _stats(phases: Sequence[Phase]) -> dict[str, Any]:
    """Every numeric figure of a phase over the repeats (median, min, max, runs)."""
    fields = [name for name, value in asdict(phases[0]).items() if isinstance(value, int | float)]
    return {name: asdict(Stat.of([float(getattr(p, name)) for p in phases])) for name in fields}


def _result(phases: dict[str, list[Phase]], *, tree: str | None = None) -> Result:
    """B9's row; with ``tree``, one of several checkouts measured side by side (``B9 <tree>``)."""
    submit, poll = phases["submit"], phases["poll"]
    return Result(
        id="B9" if tree is None else f"B9 {tree}",
        title=f"API under load, keys on, Postgres + Redis, wrk: p99 of {SUBMITS} POST /jobs "
        f"({SUBMIT_CONNECTIONS} connections), GET /jobs/{{id}} ({POLL_CONNECTIONS} connections)"
        + ("" if tree is None else f", {tree}"),
        checks=[
            Check("POST /jobs p99", Stat.of([p.p99_ms for p in submit]), "<=", TARGET_P99_MS, unit=" ms"),
            Check("GET /jobs/{id} p99", Stat.of([p.p99_ms for p in poll]), "<=", TARGET_P99_MS, unit=" ms"),
            Check.reported("POST /jobs rps", Stat.of([p.rps for p in submit]), unit=" /s"),
            Check.reported("GET /jobs/{id} rps", Stat.of([p.rps for p in poll]), unit=" /s"),
        ],
        details={
            "submits": SUBMITS,
            "submit_connections": SUBMIT_CONNECTIONS,
            "poll_connections": POLL_CONNECTIONS,
            "poll_seconds": POLL_SECONDS,
            "generator": "wrk, 1 thread, pinned to core " + str(generator_core()),
            "submit": _stats(submit),
            "poll": _stats(poll),
        },
    )


def _measure_trees(trees: dict[str, Path], repeats: int, *, profile: Path | None) -> dict[str, dict[str, list[Phase]]]:
    """Each tree measured ``repeats`` times, on a fresh deployment each, alternating which goes first."""
    require_wrk()
    measured: dict[str, dict[str, list[Phase]]] = {name: {"submit": [], "poll": []} for name in trees}
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-b9-models-") as models:
        body = _job_body(Path(models))
        for repeat in range(repeats):
            order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
            for name in order:
                with deployment(trees[name], Path(models)) as served:
                    phases = measure(served, body, profile=profile and profile / f"{name}-{repeat}")
                for phase, figures in phases.items():
                    measured[name][phase].append(figures)
                logger.info("B9 %s, repeat %d: %s", name, repeat, {k: asdict(v) for k, v in phases.items()})
    return measured


def run(repeats: int) -> list[Result]:
    measured = _measure_trees({"this checkout": REPO}, repeats, profile=None)
    return [_result(measured["this checkout"])]


def main(argv: list[str] | None = None) -> int:
    from benchmarks import results

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH", help="a checkout to measure (default: this one)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default results/<date>.json)")
    parser.add_argument("--profile", type=Path, default=None, help="directory for py-spy's collapsed stacks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    trees = trees_argument(parser, args.tree)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    measured = _measure_trees(trees, args.repeats, profile=args.profile)
    rows = [_result(phases, tree=name if args.tree else None) for name, phases in measured.items()]
    path = results.write(rows, repeats=args.repeats, path=args.output)
    results.print_table(rows)
    results.Console().print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
