"""Control and fault tolerance with real processes: cancel, pause, lost workers, resume, SSE.

Nothing is mocked: workers are SIGKILLed, Redis servers stopped, streams read over HTTP.
Short lease and reconcile periods keep the waits to seconds.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource
from sqlalchemy import create_engine, text

from cli.samples import build_tiny_model, seed_config, write_text_dataset
from shared.ports import free_port
from tests.services import LoopbackS3, fresh_postgres_schema

from .conftest import ARTIFACTS_BUCKET, s3_artifacts_env
from .harness import Tuneq, wait_gone, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.spread]

FAST_CONTROL = {
    "TUNEQ_LEASE_TTL_SECONDS": "6",
    "TUNEQ_RECONCILE_SECONDS": "1",
    "TUNEQ_REPUBLISH_AFTER_SECONDS": "4",
    "TUNEQ_CANCEL_GRACE_SECONDS": "20",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("control") / "data"
    build_tiny_model(data / "tiny-gpt-neo")
    write_text_dataset(data / "train.jsonl", records=64)
    return data


def body(data: Path, **training: Any) -> dict[str, Any]:
    return {
        "model": str(data / "tiny-gpt-neo"),
        "dataset": str(data / "train.jsonl"),
        "deepspeed_config": seed_config(fp16=False, lr=1e-3),
        "training": {"max_seq_length": 48, **training},
    }


def long_job(data: Path, **training: Any) -> dict[str, Any]:
    return body(data, epochs=1000, max_steps=100_000, **training)


def service(tmp_path: Path, data: Path, **env: str) -> Tuneq:
    return Tuneq(home=tmp_path / "home", env={"TUNEQ_ALLOWED_ROOTS": str(data), **FAST_CONTROL, **env}, split=True)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, data: Path, redis_url: str) -> Iterator[Tuneq]:
    """One service (Redis as the broker) for the tests that neither kill its processes nor need
    settings of their own: each starts in ~10 s, most of it the warm start's imports."""
    tuneq = service(tmp_path_factory.mktemp("shared"), data, TUNEQ_BROKER_URL=redis_url).start()
    yield tuneq
    tuneq.stop()


# The tests on `shared` run one after the other in one test process; the others spread out.
on_shared_service = pytest.mark.xdist_group("test_control-shared")


@pytest.fixture
def pg(postgres_url: str) -> str:
    return fresh_postgres_schema(postgres_url)


@on_shared_service
def test_cancel_stops_every_rank_within_the_grace_period(shared: Tuneq, data: Path) -> None:
    tuneq = shared
    job = tuneq.submit(long_job(data))
    queued_behind = tuneq.submit(long_job(data))  # one job per worker: this one waits
    wait_until(lambda: tuneq.job(job["id"])["step"] >= 3, timeout=180, what="no steps", tuneq=tuneq)
    ranks = tuneq.ranks_of(job["id"])
    assert ranks, "no rank processes found"
    assert tuneq.client.post(f"/jobs/{queued_behind['id']}/cancel").json()["status"] == "cancelled"
    started = time.monotonic()
    answer = tuneq.client.post(f"/jobs/{job['id']}/cancel").json()
    assert answer["status"] in ("cancelling", "cancelled")
    done = tuneq.wait(job["id"], timeout=60)
    assert done["status"] == "cancelled" and done["error"]["code"] == "cancelled"
    assert time.monotonic() - started < 20  # the grace period
    assert wait_gone(ranks, timeout=5) == []
    assert tuneq.client.post(f"/jobs/{job['id']}/cancel").status_code == 200
    statuses = [
        e["data"]["status"] for e in tuneq.get(f"/jobs/{job['id']}/events?limit=1000")["data"] if e["type"] == "status"
    ]
    assert statuses == ["queued", "running", "cancelling", "cancelled"]
    # The worker is free again and never restarts a cancelled job.
    short = tuneq.wait(tuneq.submit(body(data, max_steps=3))["id"], timeout=120)
    assert short["status"] == "succeeded"
    assert tuneq.job(job["id"])["status"] == "cancelled" and tuneq.job(job["id"])["attempts"] == 1


def all_events(tuneq: Tuneq, job_id: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while page := tuneq.get(f"/jobs/{job_id}/events?after={events[-1]['id'] if events else 0}&limit=1000")["data"]:
        events += page
    return events


@on_shared_service
def test_pause_frees_the_worker_and_resume_continues_from_the_pause_step(shared: Tuneq, data: Path) -> None:
    tuneq = shared
    database = create_engine(f"sqlite:///{tuneq.home / 'tuneq.sqlite'}")
    try:
        steps = 200  # enough that the pause comes long before the end
        job = tuneq.submit(body(data, epochs=100, max_steps=steps, checkpoint_every_steps=50))
        wait_until(lambda: tuneq.job(job["id"])["step"] >= 5, timeout=180, what="no steps", tuneq=tuneq)
        ranks = tuneq.ranks_of(job["id"])
        assert ranks, "no rank processes found"
        assert tuneq.client.post(f"/jobs/{job['id']}/pause").json()["status"] == "pausing"
        paused = tuneq.wait(job["id"], timeout=120, until={"paused"})
        step = paused["step"]
        assert 5 <= step < steps and paused["pauses"] == 1 and paused["attempts"] == 1
        # A checkpoint at the pause step (between two checkpoint_every_steps), published and listed.
        checkpoints = tuneq.get(f"/jobs/{job['id']}/checkpoints")["data"]
        assert (step, "deepspeed") in {(c["step"], c["kind"]) for c in checkpoints}
        assert all(c["kind"] == "deepspeed" for c in checkpoints)  # no export: the job has not ended
        event = [e["data"] for e in all_events(tuneq, job["id"]) if e["data"].get("status") == "paused"]
        assert event == [{"status": "paused", "step": step, "attempt": 1, "checkpoint": f"step-{step:08d}"}]
        # The ranks are gone and the worker is free: idle, the job holds neither it nor a lease.
        assert wait_gone(ranks, timeout=10) == []

        def worker_idle() -> bool:
            with database.connect() as conn:
                idle = conn.execute(text("SELECT count(*) FROM workers WHERE idle_since IS NOT NULL")).scalar()
                query = text("SELECT worker_id, lease_expires_at FROM jobs WHERE id = :id")
                holder = conn.execute(query, {"id": job["id"].replace("-", "")}).one()
            return idle == 1 and tuple(holder) == (None, None)

        wait_until(worker_idle, timeout=30, what="the worker never became idle", tuneq=tuneq)
        assert tuneq.job(job["id"])["status"] == "paused"
        assert tuneq.client.post(f"/jobs/{job['id']}/pause").json()["status"] == "paused"  # again: no change

        assert tuneq.client.post(f"/jobs/{job['id']}/resume").json()["status"] == "queued"
        done = tuneq.wait(job["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        assert (done["attempts"], done["pauses"], done["step"]) == (2, 1, steps)
        # Every step trained and recorded exactly once, the second attempt from the pause step on.
        events = all_events(tuneq, job["id"])
        assert sorted(e["data"]["step"] for e in events if e["type"] == "metric") == list(range(1, steps + 1))
        metrics = tuneq.get(f"/jobs/{job['id']}/metrics")["data"]
        assert [m["step"] for m in metrics] == list(range(1, steps + 1))
        resumed = [e["data"] for e in events if e["type"] == "resumed"]
        assert len(resumed) == 1 and (resumed[0]["from_step"], resumed[0]["attempt"]) == (step, 2)
        statuses = [e["data"]["status"] for e in events if e["type"] == "status"]
        assert statuses == ["queued", "running", "pausing", "paused", "queued", "running", "succeeded"]
    finally:
        database.dispose()


@on_shared_service
def test_timeout_fails_the_job(shared: Tuneq, data: Path) -> None:
    job = shared.wait(shared.submit(long_job(data, max_duration_seconds=8))["id"], timeout=120)
    assert job["status"] == "failed" and job["error"]["code"] == "timeout"
    assert "max_duration_seconds" in job["error"]["message"]


def test_a_killed_worker_is_replaced_and_the_job_resumes_from_its_checkpoint(
    tmp_path: Path, data: Path, pg: str, redis_url: str, loopback_s3: LoopbackS3
) -> None:
    """The new worker is on another "host": an empty TUNEQ_HOME, the checkpoint comes from S3."""
    store = s3_artifacts_env(loopback_s3, "killed")
    tuneq = service(tmp_path, data, TUNEQ_DATABASE_URL=pg, TUNEQ_BROKER_URL=redis_url, **store).start()
    try:
        # Enough steps that the kill comes long before the end; checkpoints often enough that
        # the first comes early.
        steps = 240
        job = tuneq.submit(body(data, epochs=100, max_steps=steps, checkpoint_every_steps=10))
        checkpoint = wait_until(
            lambda: [c for c in tuneq.get(f"/jobs/{job['id']}/checkpoints")["data"] if c["kind"] == "deepspeed"],
            timeout=180,
            what="no checkpoint",
            tuneq=tuneq,
        )
        ranks = tuneq.ranks_of(job["id"])
        assert ranks
        tuneq.kill(tuneq.processes[1])  # the worker and its pool, SIGKILL
        assert tuneq.job(job["id"])["step"] < steps, "the job finished before the worker was killed"
        assert wait_gone(ranks, timeout=30) == []
        new_host = tmp_path / "new-host"
        tuneq.start_worker(TUNEQ_HOME=str(new_host))
        done = tuneq.wait(job["id"], timeout=400)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == 2
        metrics = tuneq.get(f"/jobs/{job['id']}/metrics")["data"]
        assert [m["step"] for m in metrics] == list(range(1, steps + 1))
        events = tuneq.get(f"/jobs/{job['id']}/events?limit=1000")["data"]
        resumed = [e["data"] for e in events if e["type"] == "resumed"]
        assert len(resumed) == 1 and resumed[0]["from_step"] >= checkpoint[0]["step"]
        assert resumed[0]["from_step"] % 10 == 0
        resumed_at = datetime.fromisoformat(next(e["created_at"] for e in events if e["type"] == "resumed"))
        after = [datetime.fromisoformat(m["time"]) for m in metrics if m["step"] > resumed[0]["from_step"]]
        assert after and min(after) > resumed_at  # the lost attempt's rows after the checkpoint were superseded
        warnings = [e["data"]["message"] for e in events if e["type"] == "warning"]
        assert any("stopped renewing its lease" in w for w in warnings)
        # Every step after the resume point was trained by the second attempt, continuing the count.
        assert done["step"] == steps and done["tokens_seen"] > 0
        # The new host's disk was empty: the checkpoint it resumed from came from the store. Its
        # disk is a cache of the store, holding the newest checkpoint only.
        local = new_host / "runs" / job["id"] / "checkpoints"
        assert sorted(p.name for p in local.glob("step-*")) == [f"step-{steps:08d}"]
    finally:
        tuneq.stop()


def test_a_worker_on_a_home_of_its_own_without_the_shared_store_is_refused_at_start(
    tmp_path: Path, data: Path, pg: str, redis_url: str
) -> None:
    """Issue 41: TUNEQ_ARTIFACTS_URI left unset, the API and the first worker share a home, and
    a worker on another host's home names its own TUNEQ_HOME/runs. It used to start, fail to
    fetch the checkpoint for 30 s while its lease ran out, and lose the job as `worker_lost`
    after three such attempts. It now refuses to start, naming the setting; one naming the
    deployment's store (here a directory, as a mount every host shares) resumes the job."""
    tuneq = service(tmp_path, data, TUNEQ_DATABASE_URL=pg, TUNEQ_BROKER_URL=redis_url).start()
    try:
        steps = 240
        job = tuneq.submit(body(data, epochs=100, max_steps=steps, checkpoint_every_steps=10))
        wait_until(
            lambda: tuneq.get(f"/jobs/{job['id']}/checkpoints")["data"], timeout=180, what="no checkpoint", tuneq=tuneq
        )
        ranks = tuneq.ranks_of(job["id"])
        tuneq.kill(tuneq.processes[1])  # the worker and its pool, SIGKILL
        assert tuneq.job(job["id"])["step"] < steps, "the job finished before the worker was killed"
        assert wait_gone(ranks, timeout=30) == []
        new_host = tmp_path / "new-host"
        refused = tuneq.start_worker(TUNEQ_HOME=str(new_host))
        assert refused.wait(timeout=120) == 1
        log = tuneq.log.read_text(errors="replace")
        assert f"tuneq: TUNEQ_ARTIFACTS_URI {new_host / 'runs'} is not this deployment's artifact store" in log
        assert f"records {tmp_path / 'home' / 'runs'}" in log
        tuneq.processes.remove(refused)

        tuneq.start_worker(TUNEQ_HOME=str(new_host), TUNEQ_ARTIFACTS_URI=str(tmp_path / "home" / "runs"))
        done = tuneq.wait(job["id"], timeout=400)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == 2 and done["step"] == steps
    finally:
        tuneq.stop()


def test_the_store_going_away_mid_run_delays_uploads_not_the_job(
    tmp_path: Path, data: Path, loopback_s3: LoopbackS3
) -> None:
    """The S3 endpoint stops after the first checkpoint and comes back: uploads are retried,
    training waits at most at its next save, and the job ends with exactly the checkpoints its
    retention keeps in S3. An outage longer than the deadline then fails a job plainly, its
    files kept on the worker."""
    store = s3_artifacts_env(loopback_s3, "outage")
    tuneq = service(tmp_path, data, **store, TUNEQ_ARTIFACT_UPLOAD_DEADLINE_SECONDS="20").start()
    try:
        job = tuneq.submit(body(data, epochs=100, max_steps=30, checkpoint_every_steps=5, keep_checkpoints=2))
        wait_until(
            lambda: tuneq.get(f"/jobs/{job['id']}/checkpoints")["data"],
            timeout=180,
            what="no checkpoint",
            tuneq=tuneq,
        )
        loopback_s3.stop()

        def artifact_events() -> list[str]:
            events = tuneq.get(f"/jobs/{job['id']}/events?limit=1000")["data"]
            return [e["data"]["state"] for e in events if e["type"] == "artifact"]

        wait_until(lambda: "retrying" in artifact_events(), timeout=120, what="no retry event", tuneq=tuneq)
        time.sleep(2)
        loopback_s3.start()
        done = tuneq.wait(job["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        assert {"retrying", "recovered"} <= set(artifact_events())
        events = tuneq.get(f"/jobs/{job['id']}/events?limit=1000")["data"]
        deleted = [e["data"]["step"] for e in events if e["type"] == "artifact" and e["data"]["state"] == "deleted"]
        assert deleted == [5, 10, 15, 20]
        # Retention (keep_checkpoints 2): exactly the newest two DeepSpeed checkpoints and the model
        # are listed, and the store holds exactly their files and the log.
        checkpoints = tuneq.get(f"/jobs/{job['id']}/checkpoints")["data"]
        assert [(c["step"], c["kind"]) for c in checkpoints] == [(25, "deepspeed"), (30, "deepspeed"), (30, "model")]
        artifacts = tuneq.get(f"/jobs/{job['id']}/artifacts")["data"]
        assert {(a["kind"], a["step"]) for a in artifacts} == {
            ("deepspeed", 25),
            ("deepspeed", 30),
            ("model", 30),
            ("log", None),
        }
        listing = loopback_s3.client().list_objects_v2(Bucket=ARTIFACTS_BUCKET, Prefix=f"outage/{job['id']}/")
        assert {o["Key"] for o in listing["Contents"]} == {f"outage/{job['id']}/{a['path']}" for a in artifacts}
        # The worker's disk keeps only the newest checkpoint, as a cache.
        local = tmp_path / "home" / "runs" / job["id"] / "checkpoints"
        assert sorted(p.name for p in local.glob("step-*")) == ["step-00000030"]

        # Down for longer than TUNEQ_ARTIFACT_UPLOAD_DEADLINE_SECONDS: the job fails, nothing half is listed.
        loopback_s3.stop()
        lost = tuneq.wait(
            tuneq.submit(body(data, epochs=100, max_steps=10, checkpoint_every_steps=5))["id"], timeout=300
        )
        assert lost["status"] == "failed" and lost["error"]["code"] == "artifact_store_unavailable", lost["error"]
        assert "TUNEQ_ARTIFACT_UPLOAD_DEADLINE_SECONDS" in lost["error"]["message"]
        assert tuneq.get(f"/jobs/{lost['id']}/checkpoints")["data"] == []
        kept = tmp_path / "home" / "runs" / lost["id"] / "checkpoints" / "step-00000005" / "tuneq-manifest.json"
        assert kept.is_file()
    finally:
        loopback_s3.stop()
        loopback_s3.start()
        tuneq.stop()


def test_a_poison_job_fails_after_max_restarts_plus_one_attempts(tmp_path: Path, data: Path) -> None:
    """A job whose worker dies on every attempt ends failed, not in a loop."""
    tuneq = service(tmp_path, data).start()
    try:
        job = tuneq.submit({**long_job(data), "max_restarts": 1})
        for attempt in (1, 2):
            wait_until(
                lambda a=attempt: tuneq.job(job["id"])["attempts"] == a and tuneq.job(job["id"])["status"] == "running",
                timeout=120,
                what=f"attempt {attempt} never ran",
                tuneq=tuneq,
            )
            tuneq.kill(tuneq.processes[-1])
            tuneq.start_worker()
        done = tuneq.wait(job["id"], timeout=120)
        assert done["status"] == "failed" and done["error"]["code"] == "worker_lost"
        assert done["attempts"] == 2 and "gave up after 2 attempts" in done["error"]["message"]
        time.sleep(3)
        assert tuneq.job(job["id"])["attempts"] == 2  # and it stays that way
    finally:
        tuneq.stop()


@pytest.fixture
def own_redis() -> Iterator[tuple[str, Any]]:
    """A Redis server of this test's own, so the test can stop and start it."""
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    state: dict[str, subprocess.Popen[bytes] | None] = {"server": None}

    def start() -> None:
        state["server"] = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=port).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)

    def stop() -> None:
        server = state["server"]
        if server is not None:
            server.terminate()
            server.wait()
            state["server"] = None

    try:
        yield f"redis://127.0.0.1:{port}/0", (start, stop)
    finally:
        stop()


def test_a_job_submitted_while_the_broker_is_down_runs_once_it_is_back(
    tmp_path: Path, data: Path, own_redis: tuple[str, Any]
) -> None:
    url, (start_redis, stop_redis) = own_redis
    tuneq = service(tmp_path, data, TUNEQ_BROKER_URL=url)
    tuneq.start(workers=0, ready="/healthz")
    try:
        assert tuneq.client.get("/readyz").status_code == 503
        began = time.monotonic()
        job = tuneq.submit(body(data, max_steps=4))
        assert time.monotonic() - began < 10 and job["status"] == "queued"
        start_redis()
        tuneq.start_worker()
        done = tuneq.wait(job["id"], timeout=180)
        assert done["status"] == "succeeded" and done["attempts"] == 1
        time.sleep(6)  # past the republish period: a late duplicate must not run it again
        assert tuneq.job(job["id"])["attempts"] == 1
    finally:
        tuneq.stop()
        stop_redis()


def test_a_redelivered_message_does_not_run_the_job_twice(tmp_path: Path, data: Path, redis_url: str) -> None:
    # A lease longer than FAST_CONTROL's: leases are not what this test is about, and a 6 s one
    # once lapsed on a loaded CI machine (attempts 2: a requeue, not a second delivery run).
    tuneq = service(
        tmp_path,
        data,
        TUNEQ_BROKER_URL=redis_url,
        TUNEQ_REDIS_VISIBILITY_TIMEOUT_SECONDS="2",
        TUNEQ_LEASE_TTL_SECONDS="30",
    )
    tuneq.start(workers=2)
    try:
        job = tuneq.submit(body(data, epochs=100, max_steps=300))
        done = tuneq.wait(job["id"], timeout=300)
        assert done["status"] == "succeeded" and done["attempts"] == 1
        log = tuneq.log.read_text(errors="replace")
        assert "this delivery does nothing" in log, "Redis never redelivered: the test proves nothing"
        statuses = [
            e["data"]["status"]
            for e in tuneq.get(f"/jobs/{job['id']}/events?limit=1000")["data"]
            if e["type"] == "status"
        ]
        assert statuses == ["queued", "running", "succeeded"]
    finally:
        tuneq.stop()


def read_sse(response: httpx.Response, *, until: Any) -> list[dict[str, Any]]:
    """The stream's events (as the client reads them: httpx-sse) until ``until(events)`` holds."""
    events: list[dict[str, Any]] = []
    for message in EventSource(response).iter_sse():
        if not message.data:
            continue  # a keep-alive ping: httpx-sse yields one (with the last id) per ping comment
        events.append({"id": int(message.id), "event": message.event, "data": json.loads(message.data)})
        if until(events):
            break
    return events


@on_shared_service
def test_sse_shows_metrics_live_and_resumes_after_last_event_id(shared: Tuneq, data: Path) -> None:
    tuneq = shared
    job = tuneq.submit(body(data, epochs=100, max_steps=400))
    url = f"/jobs/{job['id']}/events/stream"
    with tuneq.client.stream("GET", url, timeout=120) as response:
        seen = read_sse(response, until=lambda evs: sum(e["event"] == "metric" for e in evs) >= 3)
    assert tuneq.job(job["id"])["status"] == "running"  # live, not after the fact
    last = seen[-1]["id"]
    with tuneq.client.stream("GET", url, headers={"Last-Event-ID": str(last)}, timeout=300) as response:
        rest = read_sse(response, until=lambda evs: False)  # to the end of the stream
    assert rest[-1]["event"] == "status" and rest[-1]["data"]["data"]["status"] == "succeeded"
    stored = []
    cursor = last
    while True:
        page = tuneq.get(f"/jobs/{job['id']}/events?after={cursor}&limit=1000")
        stored += page["data"]
        if page["next_cursor"] is None:
            break
        cursor = page["next_cursor"]
    assert [e["id"] for e in rest] == [e["id"] for e in stored]  # exactly the events after it
    assert [e["id"] for e in seen + rest] == sorted({e["id"] for e in seen + rest})
    progress = tuneq.job(job["id"])
    assert progress["total_steps"] == 400 and progress["epoch"] is not None and progress["tokens_seen"] > 0
