"""The HTTP contract, in process, on SQLite and on Postgres."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from cli.samples import seed_config
from shared.db.engine import get_engine
from shared.db.lifecycle import finish_job, record_event, register_worker
from shared.db.models import EventType, Job, Worker, utcnow
from shared.jobs.run_layout import RunLayout
from shared.jobs.status import JobStatus
from tests.shared.data.preference_records import OPENAI_DPO


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:
        yield c


def write_job(job_id: str, **values: Any) -> None:
    """A change made outside this API process, as a worker (or another replica) makes it."""
    with Session(get_engine()) as session:
        job = session.get(Job, uuid.UUID(job_id))
        assert job is not None
        for name, value in values.items():
            setattr(job, name, value)
        session.add(job)
        session.commit()


def record_log_lines(job_id: str, *lines: str) -> None:
    """Training log lines as the worker's ingestor records them: ``log`` events in SQL."""
    with Session(get_engine()) as session:
        for line in lines:
            record_event(session, job_id=uuid.UUID(job_id), type=EventType.log, data={"line": line})
        session.commit()


def job_count() -> int:
    with Session(get_engine()) as session:
        return len(session.exec(select(Job)).all())


def test_submit_returns_the_queued_job(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post("/jobs", json={**body, "name": "first", "training": {"max_steps": 5}})
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued" and job["name"] == "first"
    assert job["training"]["max_steps"] == 5 and job["training"]["epochs"] == 1
    assert job["deepspeed_config"] == body["deepspeed_config"]
    assert job["num_gpus"] == 1 and job["step"] == 0 and job["error"] is None
    assert job["created_at"].endswith(("Z", "+00:00"))  # UTC, with its zone
    assert client.get(f"/jobs/{job['id']}").json() == job


def test_max_seq_length_follows_a_local_models_positions(
    client: TestClient, body: dict[str, Any], model_dir: Path
) -> None:
    (model_dir / "config.json").write_text('{"max_position_embeddings": 128}')
    left_out = client.post("/jobs", json=body)
    assert left_out.status_code == 201, left_out.text
    assert left_out.json()["training"]["max_seq_length"] == 128  # not 512: the model has 128 positions
    too_long = client.post("/jobs", json={**body, "training": {"max_seq_length": 256}})
    assert too_long.status_code == 422
    problem = too_long.json()["detail"][0]
    assert problem["loc"] == ["body", "training", "max_seq_length"]
    assert "exceeds the model's 128 positions: set it to 128 or less" in problem["msg"]
    assert job_count() == 1


def test_invalid_submit_is_422_naming_the_field_and_creates_no_row(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post(
        "/jobs", json={**body, "deepspeed_config": {**body["deepspeed_config"], "zero_optimizaton": {}}}
    )
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail[0]["loc"] == ["body", "deepspeed_config", "zero_optimizaton"]
    assert "did you mean 'zero_optimization'" in detail[0]["msg"]
    assert job_count() == 0


def test_unknown_body_field_is_refused(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post("/jobs", json={**body, "gpus": 2})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "gpus"]
    assert job_count() == 0


def test_fp16_is_refused_when_every_live_worker_is_cpu_only(client: TestClient, body: dict[str, Any]) -> None:
    with Session(get_engine()) as session:
        session.add(Worker(id="w1", hostname="h", accelerator="cpu", device_count=2))
        session.add(
            Worker(
                id="old", hostname="h", accelerator="cuda", device_count=8, last_seen_at=utcnow() - timedelta(days=1)
            )
        )
        session.commit()
    response = client.post("/jobs", json={**body, "deepspeed_config": seed_config(fp16=True)})
    assert response.status_code == 422
    assert "fp16 needs a CUDA GPU" in response.json()["detail"][0]["msg"]
    assert client.post("/jobs", json=body).status_code == 201


def test_list_is_newest_first_filtered_and_paginated(client: TestClient, body: dict[str, Any]) -> None:
    ids = [client.post("/jobs", json={**body, "name": f"j{i}"}).json()["id"] for i in range(3)]
    write_job(ids[0], status=JobStatus.failed)
    listed = client.get("/jobs").json()
    assert [j["id"] for j in listed["data"]] == ids[::-1] and listed["count"] == 3
    page = client.get("/jobs", params={"skip": 1, "limit": 1}).json()
    assert [j["id"] for j in page["data"]] == [ids[1]] and page["count"] == 3
    failed = client.get("/jobs", params={"status": "failed"}).json()
    assert [j["id"] for j in failed["data"]] == [ids[0]] and failed["count"] == 1
    assert client.get("/jobs", params={"status": "bogus"}).status_code == 422


def test_unknown_job_is_404_everywhere(client: TestClient) -> None:
    missing = uuid.uuid4()
    for path in ("", "/metrics", "/checkpoints", "/logs"):
        assert client.get(f"/jobs/{missing}{path}").status_code == 404
    assert client.get("/jobs/not-a-uuid").status_code == 422


def test_metrics_come_a_page_at_a_time_or_downsampled_for_a_chart(client: TestClient, body: dict[str, Any]) -> None:
    """A 200 000-step run used to answer every row on every call."""
    from sqlalchemy import insert

    from shared.db.models import JobEvent, JobMetric, utcnow

    job_id = client.post("/jobs", json=body).json()["id"]
    with Session(get_engine()) as session:
        now = utcnow()
        session.execute(
            insert(JobMetric),
            [{"job_id": uuid.UUID(job_id), "step": step, "loss": 1 / step, "time": now} for step in range(1, 2501)],
        )
        session.commit()
        newest_event = max(e.id for e in session.exec(select(JobEvent).where(JobEvent.job_id == uuid.UUID(job_id))))

    def page(**params: Any) -> dict[str, Any]:
        response = client.get(f"/jobs/{job_id}/metrics", params=params)
        assert response.status_code == 200, response.text
        return dict(response.json())

    steps: list[int] = []
    after, pages = 0, 0
    while True:
        got = page(after=after)
        steps += [m["step"] for m in got["data"]]
        pages += 1
        assert got["event_cursor"] == newest_event
        if not got["has_more"]:
            break
        after = got["next_after"]
    assert steps == list(range(1, 2501)) and pages == 3  # 1000 a page by default
    assert [m["step"] for m in page(after=2490, limit=5)["data"]] == [2491, 2492, 2493, 2494, 2495]
    chart = [m["step"] for m in page(points=100)["data"]]
    assert chart == list(range(25, 2501, 25))  # the last step of each of 100 stretches of 25
    tail = [m["step"] for m in page(points=10, after=2000)["data"]]
    assert tail == list(range(2050, 2501, 50))
    assert page(points=5000)["data"][0]["step"] == 1 and len(page(points=5000, limit=3000)["data"]) == 2500
    assert client.get(f"/jobs/{job_id}/metrics", params={"limit": 10_001}).status_code == 422
    # The client pages through them the same way.
    from cli.client import ClientSettings, TuneqClient

    def through_the_app(request: httpx.Request) -> httpx.Response:
        answer = client.request(request.method, str(request.url), headers=request.headers, content=request.content)
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    api = TuneqClient(ClientSettings(url=str(client.base_url)), transport=httpx.MockTransport(through_the_app))
    assert [m["step"] for m in api.metrics(job_id)] == list(range(1, 2501))
    assert [m["step"] for m in api.metrics(job_id, points=100)] == list(range(25, 2501, 25))


def test_a_dpo_jobs_measures_and_phase_come_back_under_trls_names(
    client: TestClient, body: dict[str, Any], tmp_path: Path
) -> None:
    """As the worker ingests them: /metrics answers rewards/chosen and the rest (paged and
    downsampled alike), the job shows its phase, the events carry the phase reports."""
    from sqlmodel import Session

    from tests.worker.test_ingest import DPO_MEASURES, dpo_metric, metric, phase
    from worker.ingest import EventIngestor

    job_id = client.post("/jobs", json=body).json()["id"]
    events = tmp_path / "events-1.jsonl"
    lines = [phase(0, 8), phase(8, 8), *(dpo_metric(step, rewards_margins=step / 10) for step in range(1, 5))]
    events.write_text("\n".join([*lines, metric(5, 0.5)]) + "\n")
    with Session(get_engine()) as session:
        assert EventIngestor(events_path=events, log_path=None, job_id=uuid.UUID(job_id)).poll(session) == 7

    trl = {
        "rewards/chosen": 0.5,
        "rewards/rejected": -0.25,
        "rewards/accuracies": 0.75,
        "rewards/margins": 0.1,  # step 1's
        "logps/chosen": -12.5,
        "logps/rejected": -20.0,
        "logits/chosen": 0.125,
        "logits/rejected": -0.125,
        "eval_rewards/accuracies": 0.875,
    }
    assert len(trl) == len(DPO_MEASURES)
    rows = client.get(f"/jobs/{job_id}/metrics").json()["data"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert {name: rows[0][name] for name in trl} == trl
    assert not set(DPO_MEASURES) & set(rows[0])  # only under TRL's names
    assert rows[0]["loss"] == 0.6 and rows[0]["eval_loss"] is None  # the others keep their names
    assert all(rows[4][name] is None for name in trl)  # every measure in every row, null when not measured
    chart = client.get(f"/jobs/{job_id}/metrics", params={"points": 2}).json()["data"]
    assert [(r["step"], r["rewards/margins"]) for r in chart] == [(3, 0.3), (5, None)]
    schema = client.get("/openapi.json").json()["components"]["schemas"]["MetricPublic"]
    assert set(trl) <= set(schema["required"])

    job = client.get(f"/jobs/{job_id}").json()
    assert job["phase"] == {
        "name": "reference_logps",
        "done": 8,
        "total": 8,
        "cached": False,
        "time": "2026-01-01T00:00:00Z",
    }
    stream = client.get(f"/jobs/{job_id}/events").json()["data"]
    assert [(e["type"], e["data"].get("done")) for e in stream if e["type"] == "phase"] == [("phase", 0), ("phase", 8)]
    assert [e["data"]["rewards_accuracies"] for e in stream if e["type"] == "metric"] == [0.75] * 4 + [None]


def test_metrics_checkpoints_and_logs_of_a_new_job(client: TestClient, body: dict[str, Any]) -> None:
    job_id = client.post("/jobs", json=body).json()["id"]
    metrics = client.get(f"/jobs/{job_id}/metrics").json()
    assert metrics["data"] == [] and not metrics["has_more"] and metrics["next_after"] is None
    assert metrics["event_cursor"] > 0  # the job's "queued" status event
    assert client.get(f"/jobs/{job_id}/checkpoints").json() == {"data": []}
    assert client.get(f"/jobs/{job_id}/logs").json() == {"lines": []}
    record_log_lines(job_id, *(f"line {i}" for i in range(10)))
    assert client.get(f"/jobs/{job_id}/logs", params={"tail": 2}).json() == {"lines": ["line 8", "line 9"]}


def test_logs_tail_is_the_newest_lines_of_the_job_in_order(
    client: TestClient, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.settings import get_settings

    job_id, other_job_id = (client.post("/jobs", json={**body, "name": name}).json()["id"] for name in ("a", "b"))
    record_log_lines(job_id, *(f"line {i}" for i in range(250)))
    record_log_lines(other_job_id, "another job's line")
    write_job(job_id, status=JobStatus.running)
    record_log_lines(job_id, "line 250")  # after other events of the job, and another job's line
    lines = client.get(f"/jobs/{job_id}/logs").json()["lines"]
    assert lines == [f"line {i}" for i in range(51, 251)]  # the default tail, 200, of 251 lines

    def tail(n: int) -> list[str]:
        return list(client.get(f"/jobs/{job_id}/logs", params={"tail": n}).json()["lines"])

    assert tail(3) == ["line 248", "line 249", "line 250"]
    assert len(tail(1000)) == 251
    monkeypatch.setenv("TUNEQ_MAX_LOG_TAIL", "5")
    get_settings.cache_clear()
    assert tail(1000) == [f"line {i}" for i in range(246, 251)]  # at most TUNEQ_MAX_LOG_TAIL


def test_logs_come_from_sql_not_from_the_run_directory(client: TestClient, body: dict[str, Any]) -> None:
    """The API and the workers need not share a disk: the API never reads train.log."""
    from shared.settings import get_settings

    job_id = client.post("/jobs", json=body).json()["id"]
    layout = RunLayout.for_job(get_settings(), job_id)
    layout.root.mkdir(parents=True)
    layout.log.write_text("only on the worker's disk\nnot ingested either\n")
    record_log_lines(job_id, "recorded in SQL")
    assert client.get(f"/jobs/{job_id}/logs").json() == {"lines": ["recorded in SQL"]}
    client.post(f"/jobs/{job_id}/cancel")
    with client.stream("GET", f"/jobs/{job_id}/logs", params={"follow": True}) as stream:
        assert stream.read().decode() == "recorded in SQL\n"


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok"}


def test_readiness_fails_when_the_broker_is_down(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from shared import queue

    monkeypatch.setenv("TUNEQ_BROKER_URL", "redis://127.0.0.1:1/0")
    queue.get_celery.cache_clear()
    from shared.settings import get_settings

    get_settings.cache_clear()
    response = client.get("/readyz")
    assert response.status_code == 503 and response.json()["checks"]["broker"] == "unreachable"


def test_idempotency_key(client: TestClient, body: dict[str, Any]) -> None:
    first = client.post("/jobs", json=body, headers={"Idempotency-Key": "k1"})
    again = client.post("/jobs", json=body, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = client.post("/jobs", json={**body, "name": "other"}, headers={"Idempotency-Key": "k1"})
    assert other.status_code == 409 and "different body" in other.json()["detail"]
    assert client.post("/jobs", json=body, headers={"Idempotency-Key": "k2"}).json()["id"] != first.json()["id"]
    assert job_count() == 2


def test_cancel_a_queued_job_at_once_and_again(client: TestClient, body: dict[str, Any]) -> None:
    job_id = client.post("/jobs", json=body).json()["id"]
    cancelled = client.post(f"/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["error"]["code"] == "cancelled"
    assert client.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    assert client.post(f"/jobs/{uuid.uuid4()}/cancel").status_code == 404


def test_a_job_read_is_kept_job_cache_seconds_and_this_process_cancel_shows_at_once(
    client: TestClient, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.settings import get_settings

    monkeypatch.setenv("TUNEQ_JOB_CACHE_SECONDS", "600")  # far longer than the test: what is kept stays
    get_settings.cache_clear()
    job_id = client.post("/jobs", json=body).json()["id"]
    assert client.get(f"/jobs/{job_id}").json()["step"] == 0
    write_job(job_id, status=JobStatus.running, step=7)
    kept = client.get(f"/jobs/{job_id}").json()
    assert (kept["status"], kept["step"]) == ("queued", 0)  # written elsewhere: shows within the TTL
    cancelled = client.post(f"/jobs/{job_id}/cancel").json()
    assert (cancelled["status"], cancelled["step"]) == ("cancelling", 7)
    assert client.get(f"/jobs/{job_id}").json() == cancelled  # this process's own change: at once


def test_with_job_cache_seconds_zero_every_read_sees_the_database(
    client: TestClient, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.settings import get_settings

    monkeypatch.setenv("TUNEQ_JOB_CACHE_SECONDS", "0")
    get_settings.cache_clear()
    job_id = client.post("/jobs", json=body).json()["id"]
    assert client.get(f"/jobs/{job_id}").json()["step"] == 0
    write_job(job_id, status=JobStatus.running, step=7)
    read = client.get(f"/jobs/{job_id}").json()
    assert (read["status"], read["step"]) == ("running", 7)


def test_cancel_a_finished_job_is_409(client: TestClient, body: dict[str, Any]) -> None:
    job_id = client.post("/jobs", json=body).json()["id"]
    write_job(job_id, status=JobStatus.succeeded)
    response = client.post(f"/jobs/{job_id}/cancel")
    assert response.status_code == 409 and "already succeeded" in response.json()["detail"]


def test_pause_and_resume(client: TestClient, body: dict[str, Any]) -> None:
    queued, running, done = (client.post("/jobs", json=body).json()["id"] for _ in range(3))
    # A queued job pauses at once, and again changes nothing.
    for _ in range(2):
        paused = client.post(f"/jobs/{queued}/pause")
        assert paused.status_code == 200 and paused.json()["status"] == "paused"
    assert client.get(f"/jobs/{queued}").json()["status"] == "paused"  # this process's change: at once
    resumed = client.post(f"/jobs/{queued}/resume")
    assert resumed.status_code == 200 and resumed.json()["status"] == "queued"
    again = client.post(f"/jobs/{queued}/resume")
    assert again.status_code == 409 and "only a paused job can be resumed" in again.json()["detail"]
    # A running one goes through pausing (its worker finishes the pause); it cannot be resumed yet.
    write_job(running, status=JobStatus.running, attempts=1, worker_id="w")
    assert client.post(f"/jobs/{running}/pause").json()["status"] == "pausing"
    early = client.post(f"/jobs/{running}/resume")
    assert early.status_code == 409 and "wait until it is paused" in early.json()["detail"]
    # A finished job cannot be paused; a paused one is cancelled at once.
    write_job(done, status=JobStatus.succeeded)
    refused = client.post(f"/jobs/{done}/pause")
    assert refused.status_code == 409 and "already succeeded" in refused.json()["detail"]
    client.post(f"/jobs/{queued}/pause")
    cancelled = client.post(f"/jobs/{queued}/cancel").json()
    assert (cancelled["status"], cancelled["error"]["message"]) == ("cancelled", "cancelled while paused")
    for action in ("pause", "resume"):
        assert client.post(f"/jobs/{uuid.uuid4()}/{action}").status_code == 404
    statuses = [e["data"]["status"] for e in client.get(f"/jobs/{queued}/events").json()["data"]]
    assert statuses == ["queued", "paused", "queued", "paused", "cancelled"]
    assert client.get("/jobs", params={"status": "pausing"}).json()["count"] == 1


def test_events_page_by_cursor_and_stream_ends_after_the_terminal_status(
    client: TestClient, body: dict[str, Any]
) -> None:
    job_id = client.post("/jobs", json=body).json()["id"]
    client.post(f"/jobs/{job_id}/cancel")
    page = client.get(f"/jobs/{job_id}/events", params={"limit": 1}).json()
    assert [e["data"] for e in page["data"]] == [{"status": "queued"}]
    rest = client.get(f"/jobs/{job_id}/events", params={"after": page["next_cursor"]}).json()
    assert [e["data"]["status"] for e in rest["data"]] == ["cancelled"]
    assert client.get(f"/jobs/{job_id}/events", params={"after": rest["next_cursor"]}).json() == {
        "data": [],
        "next_cursor": None,
    }
    with client.stream("GET", f"/jobs/{job_id}/events", headers={"Accept": "text/event-stream"}) as stream:
        text = "".join(stream.iter_text())
    assert text.count("event: status") == 2 and f"id: {rest['next_cursor']}" in text
    with client.stream(
        "GET", f"/jobs/{job_id}/events/stream", headers={"Last-Event-ID": str(page["next_cursor"])}
    ) as stream:
        text = "".join(stream.iter_text())
    assert text.count("event: status") == 1 and "cancelled" in text


def test_events_of_some_types_only(client: TestClient, body: dict[str, Any]) -> None:
    """?type= (repeated): a timeline's events without the metrics and log lines between them."""
    job_id = client.post("/jobs", json=body).json()["id"]
    record_log_lines(job_id, "one", "two")
    client.post(f"/jobs/{job_id}/cancel")
    statuses = client.get(f"/jobs/{job_id}/events", params={"type": "status"}).json()
    assert [e["data"]["status"] for e in statuses["data"]] == ["queued", "cancelled"]
    both = client.get(f"/jobs/{job_id}/events", params=[("type", "status"), ("type", "log"), ("limit", "3")]).json()
    assert [e["type"] for e in both["data"]] == ["status", "log", "log"]
    refused = client.get(f"/jobs/{job_id}/events", params={"type": "metrics"})
    assert refused.status_code == 422 and "type" in refused.text


def test_logs_follow_streams_until_the_job_ends(client: TestClient, body: dict[str, Any]) -> None:
    job_id = client.post("/jobs", json=body).json()["id"]
    record_log_lines(job_id, "one", "two", "three")
    client.post(f"/jobs/{job_id}/cancel")
    with client.stream("GET", f"/jobs/{job_id}/logs", params={"tail": 2, "follow": True}) as stream:
        assert stream.headers["content-type"].startswith("text/plain")
        assert stream.read().decode() == "two\nthree\n"


def test_logs_follow_sends_new_lines_as_they_are_recorded(client: TestClient, body: dict[str, Any]) -> None:
    job_id = client.post("/jobs", json=body).json()["id"]
    record_log_lines(job_id, "one", "two")
    write_job(job_id, status=JobStatus.running)
    with client.stream("GET", f"/jobs/{job_id}/logs", params={"tail": 1, "follow": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "two"
        record_log_lines(job_id, "three", "four")
        assert [next(lines), next(lines)] == ["three", "four"]
        record_log_lines(job_id, "five")
        with Session(get_engine()) as session:  # the worker ends the job: its terminal status event
            assert finish_job(session=session, job_id=uuid.UUID(job_id), status=JobStatus.succeeded)
        record_log_lines(job_id, "after the end")
        assert list(lines) == ["five"]  # every line before the terminal status, then the end


def test_duplicate_json_keys_are_refused(client: TestClient, body: dict[str, Any]) -> None:
    import json

    raw = json.dumps(body).replace('"stage": 2', '"stage": 0, "stage": 3')
    assert '"stage": 0, "stage": 3' in raw
    response = client.post("/jobs", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert "'stage' appears twice" in response.json()["detail"][0]["msg"]
    assert job_count() == 0
    assert (
        client.post("/jobs", content=json.dumps(body), headers={"content-type": "application/json"}).status_code == 201
    )


# Lines of a local dataset that the probe (issue 41) sent: once a 500 on both routes (the nesting,
# a RecursionError), or accepted (the surrogate, the NUL: the job then failed in the tokenizer, and
# the plan answered 500). Each written as the file holds it: JSON escapes, not the characters.
HOSTILE_DATASET_LINES = [
    ("nested-5000", '{"text": "x", "meta": ' + "[" * 5000 + "]" * 5000 + "}", "line 2 is nested deeper than 32"),
    ("nested-40", '{"text": "x", "meta": ' + "[" * 40 + "]" * 40 + "}", 'line 2 field "meta" is nested deeper than 32'),
    ("lone-surrogate", '{"text": "hello \\ud800 there"}', 'line 2 field "text" contains a lone UTF-16 surrogate'),
    ("nul", '{"text": "a\\u0000b"}', 'line 2 field "text" contains a NUL character'),
    ("too-long", '{"text": "' + "a" * 20_000 + '"}', "line 2 is longer than 15000 bytes, the most one line may hold"),
]


@pytest.mark.parametrize("operation", ["/jobs", "/jobs/plan"])
@pytest.mark.parametrize(
    ("line", "said"), [case[1:] for case in HOSTILE_DATASET_LINES], ids=[case[0] for case in HOSTILE_DATASET_LINES]
)
def test_a_dataset_line_no_request_body_could_hold_is_a_422_naming_it_and_leaves_no_row(
    client: TestClient,
    body: dict[str, Any],
    dataset: Path,
    monkeypatch: pytest.MonkeyPatch,
    operation: str,
    line: str,
    said: str,
) -> None:
    from shared.settings import get_settings

    monkeypatch.setenv("TUNEQ_MAX_LINE_BYTES", "15000")  # above the 10 kB of nested-5000
    get_settings.cache_clear()
    hostile = dataset.with_name("hostile.jsonl")
    hostile.write_text('{"text": "fine"}\n' + line + '\n{"text": "fine"}\n')
    response = client.post(operation, json={**body, "dataset": str(hostile)})
    assert response.status_code == 422, response.text
    problem = response.json()["detail"][0]
    assert problem["loc"] == ["body", "dataset"]
    assert problem["msg"].startswith(f"hostile.jsonl: {said}"), problem
    assert job_count() == 0
    # The same client's next request is answered: nothing above broke the connection or the app.
    assert client.post("/jobs", json=body).status_code == 201


@pytest.mark.parametrize("operation", ["/jobs", "/jobs/plan"])
@pytest.mark.parametrize(
    ("record", "evidence"),
    [
        ({"prompt": "Who?", "chosen": " A cat.", "rejected": " A dog."}, 'line 1 has "chosen" and "rejected"'),
        (OPENAI_DPO, 'line 1 has "preferred_output" and "non_preferred_output"'),
    ],
)
def test_a_preference_file_is_a_422_naming_the_method_and_leaves_no_row(
    client: TestClient, body: dict[str, Any], dataset: Path, operation: str, record: dict[str, Any], evidence: str
) -> None:
    pairs = dataset.with_name("pairs.jsonl")
    pairs.write_text(json.dumps(record) + "\n")
    response = client.post(operation, json={**body, "dataset": str(pairs)})
    assert response.status_code == 422, response.text
    problem = response.json()["detail"][0]
    assert problem["loc"] == ["body", "dataset"]
    assert problem["msg"].startswith(
        f"pairs.jsonl holds preference records ({evidence}), for preference tuning (DPO), which a supervised "
        "fine-tuning (SFT) job cannot train on: an SFT job trains on text, prompt_completion or messages records"
    ), problem
    assert job_count() == 0


TEXT_PAIRS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"chosen": "Grass is green.", "rejected": "Grass is red."},  # TRL's implicit prompt
]
DPO_DEFAULTS = {"beta": 0.1, "loss_type": "sigmoid", "sft_weight": 0.0, "label_smoothing": 0.0}


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_a_dpo_job_on_trl_text_pairs_is_accepted_with_dpo_s_defaults_filled(
    client: TestClient, body: dict[str, Any], dataset: Path
) -> None:
    pairs = write_jsonl(dataset.with_name("pairs.jsonl"), TEXT_PAIRS)
    request = {**body, "dataset": str(pairs), "validation_dataset": str(pairs), "training": {"method": "dpo"}}
    response = client.post("/jobs", json=request)
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["training"]["method"] == "dpo"
    assert job["training"]["dpo"] == {**DPO_DEFAULTS, "normalize_by_length": False}
    assert client.get(f"/jobs/{job['id']}").json() == job
    # Given in part, the rest are DPO's defaults.
    given = client.post("/jobs", json={**request, "training": {"method": "dpo", "dpo": {"beta": 0.5}}})
    assert given.status_code == 201, given.text
    assert given.json()["training"]["dpo"] == {**DPO_DEFAULTS, "beta": 0.5, "normalize_by_length": False}
    # OpenAI's door shows the native DPO job as OpenAI shows a DPO job.
    shown = client.get(f"/v1/fine_tuning/jobs/ftjob-{uuid.UUID(job['id']).hex}").json()["method"]
    assert shown["type"] == "dpo" and shown.keys() == {"type", "dpo"}
    assert shown["dpo"]["hyperparameters"]["beta"] == 0.1


USER = {"role": "user", "content": "Who sees a tree?"}
DOG = {"role": "assistant", "content": "A dog."}
# Each bad line 2 after a good line 1 of its shape, and how the refusal starts after the file's name.
BAD_PAIRS = [
    (
        "missing-rejected",
        TEXT_PAIRS[0],
        {"prompt": "Who?", "chosen": " A cat."},
        'line 2 field "rejected" is missing: a preference record needs two answers',
    ),
    (
        "empty-preferred-output",
        OPENAI_DPO,
        {**OPENAI_DPO, "preferred_output": [{"role": "assistant", "content": ""}]},
        'line 2 field "preferred_output" is empty: give the assistant\'s answer',
    ),
    (
        "empty-chosen",
        TEXT_PAIRS[0],
        {"prompt": "Who?", "chosen": "", "rejected": " A dog."},
        'line 2 field "chosen" is empty',
    ),
    (
        "no-assistant-turn",
        {"chosen": [USER, DOG], "rejected": [USER, {**DOG, "content": "A cat."}]},
        {"chosen": [USER], "rejected": [USER, DOG]},
        'line 2 field "chosen" has no assistant answer after the message it shares with the other',
    ),
    (
        "answer-not-assistant",
        {"prompt": [USER], "chosen": [DOG], "rejected": [{**DOG, "content": "A cat."}]},
        {"prompt": [USER], "chosen": [USER], "rejected": [DOG]},
        'line 2 field chosen[0].role must be "assistant"',
    ),
    (
        "chosen-is-rejected",
        TEXT_PAIRS[0],
        {"prompt": "Who?", "chosen": " A dog.", "rejected": " A dog."},
        'line 2 field "rejected" is identical to chosen: a pair\'s answers must differ',
    ),
]


@pytest.mark.parametrize("operation", ["/jobs", "/jobs/plan"])
@pytest.mark.parametrize("field", ["dataset", "validation_dataset"])
@pytest.mark.parametrize(("good", "bad", "said"), [case[1:] for case in BAD_PAIRS], ids=[case[0] for case in BAD_PAIRS])
def test_a_bad_pair_is_a_422_naming_its_line_and_field_and_leaves_no_row(
    client: TestClient,
    body: dict[str, Any],
    dataset: Path,
    operation: str,
    field: str,
    good: dict[str, Any],
    bad: dict[str, Any],
    said: str,
) -> None:
    pairs = write_jsonl(dataset.with_name("pairs.jsonl"), [good, good])
    bad_pairs = write_jsonl(dataset.with_name("bad.jsonl"), [good, bad, good])
    request = {**body, "dataset": str(pairs), "training": {"method": "dpo"}, field: str(bad_pairs)}
    response = client.post(operation, json=request)
    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"] == ["body", field]
    assert problem["msg"].startswith(f"bad.jsonl: {said}"), problem
    assert job_count() == 0


@pytest.mark.parametrize("operation", ["/jobs", "/jobs/plan"])
@pytest.mark.parametrize(
    ("record", "evidence"),
    [
        ({"text": "hello world"}, '"text"'),
        ({"messages": [USER, DOG]}, '"messages"'),
        ({"prompt": "Who?", "completion": " A dog."}, '"prompt" and "completion"'),
    ],
)
def test_a_supervised_file_on_a_dpo_job_is_a_422_naming_the_method_and_leaves_no_row(
    client: TestClient, body: dict[str, Any], dataset: Path, operation: str, record: dict[str, Any], evidence: str
) -> None:
    sft = write_jsonl(dataset.with_name("sft.jsonl"), [record, record])
    response = client.post(operation, json={**body, "dataset": str(sft), "training": {"method": "dpo"}})
    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"] == ["body", "dataset"]
    assert problem["msg"].startswith(
        f"sft.jsonl holds supervised records (line 1 has {evidence}), for supervised fine-tuning (SFT), which a "
        'DPO job cannot train on: a DPO job trains on preference records, like {"prompt": "...", "chosen"'
    ), problem
    assert job_count() == 0


@pytest.mark.parametrize(
    ("training", "said"),
    [
        ({"dpo": {"beta": 0.2}}, 'training.dpo is for training.method "dpo": set the method, or leave dpo out'),
        ({"method": "sft", "dpo": {}}, 'training.dpo is for training.method "dpo"'),
        ({"method": "dpo", "packing": True}, "training.packing is for supervised fine-tuning: a DPO job trains on"),
        ({"method": "dpo", "dataset_format": "text"}, "training.dataset_format is for supervised fine-tuning"),
        ({"method": "dpo", "dpo": {"beta": 0}}, "greater than 0"),
        ({"method": "dpo", "dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}, "sigmoid loss only"),
    ],
)
def test_dpo_options_out_of_place_are_a_422_naming_the_field_and_leave_no_row(
    client: TestClient, body: dict[str, Any], dataset: Path, training: dict[str, Any], said: str
) -> None:
    pairs = write_jsonl(dataset.with_name("pairs.jsonl"), TEXT_PAIRS)
    for operation in ("/jobs", "/jobs/plan"):
        response = client.post(operation, json={**body, "dataset": str(pairs), "training": training})
        assert response.status_code == 422, response.text
        (problem,) = response.json()["detail"]
        assert problem["loc"][:2] == ["body", "training"] and said in problem["msg"], problem
    assert job_count() == 0


@pytest.mark.parametrize("path", ["/events/stream", "/logs?follow=true"])
def test_an_open_stream_holds_no_database_connection(client: TestClient, body: dict[str, Any], path: str) -> None:
    # Hundreds of dashboards and `--follow`s stay connected for hours; the pool has a few dozen.
    job_id = client.post("/jobs", json=body).json()["id"]
    pool = get_engine().pool
    with client.stream("GET", f"/jobs/{job_id}{path}") as response:
        assert response.status_code == 200
        # The stream's own polls take a connection for a moment; between them it holds none.
        deadline = time.monotonic() + 10
        while pool.checkedout() and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.01)
        assert pool.checkedout() == 0  # type: ignore[attr-defined]


def test_a_job_without_deepspeed_config_gets_the_one_tuneq_chooses(
    client: TestClient, body: dict[str, Any], model_dir: Path
) -> None:
    from tests.shared.deepspeed.test_chosen import LLAMA_7B

    # A 7B-shaped model and one live 80 GB GPU (TUNEQ_DEVICE_MEMORY_GIB's default): its Adam
    # state cannot stay on the GPU, so the choice is ZeRO-3 with the optimizer in CPU memory.
    (model_dir / "config.json").write_text(json.dumps(LLAMA_7B))
    with Session(get_engine()) as session:
        session.add(Worker(id="w1", hostname="h", accelerator="cuda", device_count=1))
        session.commit()
    without = {key: value for key, value in body.items() if key != "deepspeed_config"}
    response = client.post("/jobs", json={**without, "training": {"micro_batch_size": 2}})
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["deepspeed_config_chosen"] is True
    chosen = job["deepspeed_config"]
    assert chosen["zero_optimization"]["stage"] == 3
    assert chosen["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert chosen["bf16"] == {"enabled": True} and chosen["optimizer"]["type"] == "AdamW"
    resolved = job["resolved_deepspeed_config"]
    assert (resolved["train_micro_batch_size_per_gpu"], resolved["train_batch_size"]) == (2, 2)  # from training
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096  # the model's hidden size
    assert client.get(f"/jobs/{job['id']}").json() == job
    given = client.post("/jobs", json=body).json()
    assert given["deepspeed_config_chosen"] is False and given["deepspeed_config"] == body["deepspeed_config"]


def test_the_chosen_config_fits_the_memory_and_precision_the_workers_recorded(
    client: TestClient, body: dict[str, Any], model_dir: Path
) -> None:
    from tests.shared.deepspeed.test_chosen import LLAMA_7B

    # A 1-GPU 16 GiB worker without native bf16 (a T4) and an 8-GPU 80 GiB one, as they register.
    (model_dir / "config.json").write_text(json.dumps(LLAMA_7B))
    with Session(get_engine()) as session:
        for worker_id, devices, gib, bf16 in (("t4", 1, 16, False), ("h100s", 8, 80, True)):
            register_worker(
                session=session,
                worker_id=worker_id,
                hostname=worker_id,
                accelerator="cuda",
                device_count=devices,
                queue=f"tuneq-{devices}gpu",
                device_memory_bytes=gib * 2**30,
                bf16_supported=bf16,
            )
    without = {key: value for key, value in body.items() if key != "deepspeed_config"}
    # One GPU: the job may run on the T4, so its weights and optimizer go to CPU memory, in fp16
    # (TUNEQ_DEVICE_MEMORY_GIB's 80 would have kept the weights on the GPU, in bf16).
    one = client.post("/jobs", json=without)
    assert one.status_code == 201, one.text
    chosen = one.json()["deepspeed_config"]
    assert chosen["zero_optimization"]["stage"] == 3 and chosen["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert chosen["fp16"] == {"enabled": True} and chosen["bf16"] == {"enabled": False}
    # Eight GPUs: only the 80 GiB worker can run it; ZeRO-2 fits there, in bf16.
    eight = client.post("/jobs", json={**without, "num_gpus": 8})
    assert eight.status_code == 201, eight.text
    chosen = eight.json()["deepspeed_config"]
    assert chosen["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in chosen["zero_optimization"]
    assert chosen["bf16"] == {"enabled": True} and chosen["fp16"] == {"enabled": False}


def test_a_model_too_large_for_any_choice_is_422_saying_what_to_change(
    client: TestClient, body: dict[str, Any], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.settings import get_settings
    from tests.shared.deepspeed.test_chosen import LLAMA_7B

    monkeypatch.setenv("TUNEQ_DEVICE_MEMORY_GIB", "0.5")
    get_settings.cache_clear()
    (model_dir / "config.json").write_text(json.dumps(LLAMA_7B))
    response = client.post("/jobs", json={key: value for key, value in body.items() if key != "deepspeed_config"})
    assert response.status_code == 422, response.text
    problem = response.json()["detail"][0]
    assert problem["loc"] == ["body", "deepspeed_config"] and "use more GPUs" in problem["msg"]
    assert "TUNEQ_DEVICE_MEMORY_GIB: no worker has recorded its memory" in problem["msg"]
    assert job_count() == 0
