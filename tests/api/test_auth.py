"""API keys and owners: every job route answers only its owner, keys are hashed, limits hold.

In process on SQLite and on Postgres, plus ``tuneq keys`` and ``tuneq serve`` as real processes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlmodel import Session, select

from shared.artifacts.store import ArtifactStore, job_key
from shared.db.api_keys import create_key, is_loopback
from shared.db.artifacts import publish_files
from shared.db.engine import get_engine
from shared.db.lifecycle import record_event
from shared.db.models import ApiKey, ArtifactKind, DownloadLink, EventType, Job, utcnow
from shared.jobs.run_layout import RunLayout
from shared.ports import free_port
from shared.settings import get_settings

MISSING = "not found"


def auth_on(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    monkeypatch.setenv("TUNEQ_AUTH", "on")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()


def new_key(owner: str) -> str:
    with Session(get_engine()) as session:
        return create_key(session=session, owner=owner)[1]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def app_client(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    from api.main import create_app

    auth_on(monkeypatch)
    with TestClient(create_app()) as c:
        yield c


@pytest.fixture
def alice(app_client: TestClient) -> dict[str, str]:
    return bearer(new_key("alice"))


@pytest.fixture
def bob(app_client: TestClient) -> dict[str, str]:
    return bearer(new_key("bob"))


def submit(client: TestClient, headers: dict[str, str], body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    response = client.post("/jobs", json={**body, **extra}, headers=headers)
    assert response.status_code == 201, response.text
    return dict(response.json())


# Every route under /jobs/{id}: (method, path after the id, extra request arguments).
JOB_ROUTES = [
    ("GET", "", {}),
    ("GET", "/metrics", {}),
    ("GET", "/checkpoints", {}),
    ("GET", "/logs", {}),
    ("GET", "/logs", {"params": {"follow": "true"}}),
    ("GET", "/events", {}),
    ("GET", "/events", {"headers": {"Accept": "text/event-stream"}}),
    ("GET", "/events/stream", {}),
    ("GET", "/artifacts", {}),
    ("GET", "/artifacts/train.log", {}),
    ("POST", "/cancel", {}),
    ("POST", "/pause", {}),
    ("POST", "/resume", {}),
]
ROUTE_IDS = [
    "get",
    "metrics",
    "checkpoints",
    "logs",
    "logs-follow",
    "events",
    "events-sse",
    "events-stream",
    "artifacts",
    "artifact",
    "cancel",
    "pause",
    "resume",
]


@pytest.fixture
def alices_job(app_client: TestClient, alice: dict[str, str], body: dict[str, Any]) -> str:
    """alice's job, with a log line recorded and its log stored as an artifact."""
    job_id = submit(app_client, alice, body)["id"]
    layout = RunLayout.for_job(get_settings(), job_id)
    layout.root.mkdir(parents=True)
    layout.log.write_text("alice's secret log line\n")
    with Session(get_engine()) as session:  # as the worker ingests the line, and publishes the log at the end
        record_event(session, job_id=uuid.UUID(job_id), type=EventType.log, data={"line": "alice's secret log line"})
        stored = ArtifactStore.from_settings(get_settings()).put_file(layout.log, job_key(job_id, "train.log"))
        publish_files(
            session, job_id=uuid.UUID(job_id), files=[("train.log", stored)], kind=ArtifactKind.log, step=None
        )
        session.commit()
    # alice's read is kept for GET /jobs/{id} (api.read_cache): another owner still gets the 404.
    assert app_client.get(f"/jobs/{job_id}", headers=alice).status_code == 200
    return job_id


def request_job_route(
    client: TestClient, job_id: str, key: dict[str, str], route: tuple[str, str, dict[str, Any]]
) -> Any:
    method, suffix, extra = route
    headers = {**extra.get("headers", {}), **key}
    return client.request(method, f"/jobs/{job_id}{suffix}", headers=headers, params=extra.get("params", {}))


@pytest.mark.parametrize("route", JOB_ROUTES, ids=ROUTE_IDS)
def test_another_owners_job_is_not_found(
    app_client: TestClient,
    alices_job: str,
    alice: dict[str, str],
    bob: dict[str, str],
    route: tuple[str, str, dict[str, Any]],
) -> None:
    job_id, (method, suffix, extra) = alices_job, route
    headers, params = extra.get("headers", {}), extra.get("params", {})
    answer = request_job_route(app_client, job_id, bob, route)
    assert answer.status_code == 404, answer.text
    assert answer.json() == {"detail": f"job {job_id} {MISSING}"}
    # Exactly as for a job that does not exist at all.
    missing = uuid.uuid4()
    nothing = app_client.request(method, f"/jobs/{missing}{suffix}", headers={**headers, **bob}, params=params)
    assert nothing.status_code == 404 and nothing.json() == {"detail": f"job {missing} {MISSING}"}
    # The owner still sees it, and bob's cancel (pause, resume) did nothing.
    assert app_client.get(f"/jobs/{job_id}", headers=alice).json()["status"] == "queued"
    if "stream" in suffix or params or "text/event-stream" in str(headers):
        app_client.post(f"/jobs/{job_id}/cancel", headers=alice)  # so that the owner's stream ends
    if suffix not in ("/cancel", "/pause", "/resume"):
        mine = app_client.request(method, f"/jobs/{job_id}{suffix}", headers={**headers, **alice}, params=params)
        if suffix == "/logs" and not params:
            assert mine.json() == {"lines": ["alice's secret log line"]}
        elif suffix == "":
            assert mine.json()["owner"] == "alice"
        elif suffix == "/artifacts/train.log":
            assert mine.content == b"alice's secret log line\n"
        else:
            assert mine.status_code == 200, mine.text


@pytest.mark.parametrize("route", JOB_ROUTES, ids=ROUTE_IDS)
def test_an_admins_key_reads_and_changes_every_owners_job(
    app_client: TestClient, alices_job: str, alice: dict[str, str], route: tuple[str, str, dict[str, Any]]
) -> None:
    """`tuneq keys create --admin`: an operator's key sees alice's job as alice does (resume is
    a 409: the job is queued, not paused)."""
    with Session(get_engine()) as session:
        admin = bearer(create_key(session=session, owner="ops", admin=True)[1])
    _, suffix, extra = route
    if "stream" in suffix or extra.get("params") or "text/event-stream" in str(extra.get("headers")):
        app_client.post(f"/jobs/{alices_job}/cancel", headers=alice)  # so that the stream ends
    answer = request_job_route(app_client, alices_job, admin, route)
    assert answer.status_code == (409 if suffix == "/resume" else 200), answer.text


def test_an_admin_lists_every_owners_jobs_and_narrows_them_by_owner(
    app_client: TestClient, alice: dict[str, str], bob: dict[str, str], body: dict[str, Any]
) -> None:
    alices, bobs = submit(app_client, alice, body)["id"], submit(app_client, bob, body)["id"]
    with Session(get_engine()) as session:
        admin = bearer(create_key(session=session, owner="ops", admin=True)[1])
    assert app_client.get("/me", headers=admin).json() == {"owner": "ops", "admin": True}
    assert app_client.get("/me", headers=alice).json() == {"owner": "alice", "admin": False}
    every = app_client.get("/jobs", headers=admin).json()
    assert {j["id"] for j in every["data"]} == {alices, bobs} and every["count"] == 2
    assert [j["id"] for j in app_client.get("/jobs", params={"owner": "bob"}, headers=admin).json()["data"]] == [bobs]
    assert app_client.get("/jobs/lookup", params={"id_prefix": bobs[:8]}, headers=admin).json()["count"] == 1
    # Any other key lists its own jobs; naming another owner is refused, saying which key may.
    assert [j["id"] for j in app_client.get("/jobs", params={"owner": "alice"}, headers=alice).json()["data"]] == [
        alices
    ]
    refused = app_client.get("/jobs", params={"owner": "bob"}, headers=alice)
    assert refused.status_code == 403 and "--admin" in refused.json()["detail"], refused.text
    assert app_client.get("/jobs/lookup", params={"id_prefix": bobs[:8]}, headers=alice).json()["count"] == 0


def test_listing_shows_only_the_callers_jobs(
    app_client: TestClient, alice: dict[str, str], bob: dict[str, str], body: dict[str, Any]
) -> None:
    mine = [submit(app_client, alice, body, name=f"a{i}")["id"] for i in range(2)]
    theirs = submit(app_client, bob, body, name="b")["id"]
    listed = app_client.get("/jobs", headers=alice).json()
    assert [j["id"] for j in listed["data"]] == mine[::-1] and listed["count"] == 2
    assert app_client.get("/jobs", headers=alice, params={"status": "queued"}).json()["count"] == 2
    bobs = app_client.get("/jobs", headers=bob).json()
    assert [j["id"] for j in bobs["data"]] == [theirs] and bobs["count"] == 1
    with Session(get_engine()) as session:
        owners = {str(j.id): j.owner for j in session.exec(select(Job)).all()}
    assert owners == {mine[0]: "alice", mine[1]: "alice", theirs: "bob"}


def test_resume_from_another_owners_job_is_not_found(
    app_client: TestClient, alice: dict[str, str], bob: dict[str, str], body: dict[str, Any]
) -> None:
    source = submit(app_client, alice, body)["id"]
    for path in ("/jobs", "/jobs/plan"):
        refused = app_client.post(path, json={**body, "resume_from": {"job_id": source}}, headers=bob)
        assert refused.status_code == 422, refused.text
        (problem,) = refused.json()["detail"]
        assert problem["loc"] == ["body", "resume_from", "job_id"]
        assert problem["msg"] == f"job {source} {MISSING}"
    # Its owner gets past "not found" (to the missing checkpoint).
    own = app_client.post("/jobs", json={**body, "resume_from": {"job_id": source}}, headers=alice)
    assert own.status_code == 422 and "no complete DeepSpeed checkpoint" in own.json()["detail"][0]["msg"]


def test_idempotency_keys_are_per_owner(
    app_client: TestClient, alice: dict[str, str], bob: dict[str, str], body: dict[str, Any]
) -> None:
    first = app_client.post("/jobs", json=body, headers={**alice, "Idempotency-Key": "k1"})
    assert first.status_code == 201
    # Bob's "k1" is his own: a new job of his, not Alice's job and not a conflict.
    other = app_client.post("/jobs", json=body, headers={**bob, "Idempotency-Key": "k1"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    assert other.json()["owner"] == "bob"
    assert (
        app_client.post("/jobs", json=body, headers={**bob, "Idempotency-Key": "k1"}).json()["id"] == other.json()["id"]
    )
    again = app_client.post("/jobs", json=body, headers={**alice, "Idempotency-Key": "k1"})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer"}, {"Authorization": "Basic YWxpY2U6eA=="}, {"Authorization": "Bearer tq_nope"}],
    ids=["no-header", "empty-bearer", "basic", "unknown-key"],
)
def test_requests_without_a_valid_key_are_401(
    app_client: TestClient, body: dict[str, Any], headers: dict[str, str]
) -> None:
    for method, path in [("GET", "/jobs"), ("POST", "/jobs"), ("POST", "/jobs/plan"), ("GET", f"/jobs/{uuid.uuid4()}")]:
        answer = app_client.request(method, path, headers=headers, json=body if method == "POST" else None)
        assert answer.status_code == 401, (method, path, answer.text)
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert app_client.get("/healthz").status_code == 200
    assert app_client.get("/readyz").status_code == 200


def test_every_job_route_asks_for_a_key(app_client: TestClient) -> None:
    # Each route takes the owner itself (no router-wide dependency): one that forgot would answer.
    paths = {p: ops for p, ops in app_client.get("/openapi.json").json()["paths"].items() if p.startswith("/jobs")}
    assert len(paths) >= 8
    for template, operations in paths.items():
        path = template.replace("{job_id}", str(uuid.uuid4()))
        for method in operations:
            answer = app_client.request(method.upper(), path)
            assert answer.status_code == 401, (method, template, answer.text)


def test_a_revoked_key_is_401_within_key_cache_seconds_and_keys_are_stored_hashed(
    app_client: TestClient, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.db.api_keys import revoke_key

    auth_on(monkeypatch, TUNEQ_KEY_CACHE_SECONDS="0.2")
    with Session(get_engine()) as session:
        row, key = create_key(session=session, owner="carol")
    assert key.startswith(f"tq_{row.id}_") and len(key) > 40
    job_id = submit(app_client, bearer(key), body)["id"]
    with get_engine().connect() as conn:
        stored = [tuple(r) for r in conn.execute(text("SELECT * FROM api_keys"))]
    assert len(stored) == 1 and not any(key in str(value) for value in stored[0])
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest() and row.key_hash in stored[0]
    with Session(get_engine()) as session:
        used = session.get(ApiKey, row.id)
        assert used is not None and used.last_used_at is not None and used.revoked_at is None
        revoke_key(session=session, key_id=row.id)
    time.sleep(0.3)  # past the 0.2 s this process may keep a key it saw valid
    answer = app_client.get(f"/jobs/{job_id}", headers=bearer(key))
    assert answer.status_code == 401 and answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert "revoked" in answer.json()["detail"]


def test_a_valid_key_is_looked_up_once_per_key_cache_seconds(
    app_client: TestClient, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.db.api_keys import revoke_key

    auth_on(monkeypatch, TUNEQ_KEY_CACHE_SECONDS="600")  # far longer than the test: what is kept stays
    with Session(get_engine()) as session:
        row, key = create_key(session=session, owner="carol")
    job_id = submit(app_client, bearer(key), body)["id"]
    with Session(get_engine()) as session:
        revoke_key(session=session, key_id=row.id)
    # Revoked from another process (`tuneq keys revoke`): this one still knows the key as valid.
    assert app_client.get(f"/jobs/{job_id}", headers=bearer(key)).status_code == 200
    # An unknown key is refused all the same.
    assert app_client.get(f"/jobs/{job_id}", headers=bearer("tq_nope_nope")).status_code == 401
    monkeypatch.setenv("TUNEQ_KEY_CACHE_SECONDS", "0")
    get_settings.cache_clear()
    assert app_client.get(f"/jobs/{job_id}", headers=bearer(key)).status_code == 401


def test_too_many_active_jobs_is_429_with_retry_after(
    database_url: str, monkeypatch: pytest.MonkeyPatch, body: dict[str, Any]
) -> None:
    from api.main import create_app

    auth_on(monkeypatch, TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER="2")
    with TestClient(create_app()) as client:
        alice, other = bearer(new_key("alice")), bearer(new_key("bob"))
        first = submit(client, alice, body, name="1")
        submit(client, alice, body, name="2")
        refused = client.post("/jobs", json={**body, "name": "3"}, headers=alice)
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "30"
        assert "2 active jobs" in refused.json()["detail"] and "at most 2" in refused.json()["detail"]
        assert client.get("/jobs", headers=alice).json()["count"] == 2
        submit(client, other, body)  # the limit is per owner
        client.post(f"/jobs/{first['id']}/cancel", headers=alice)
        third = submit(client, alice, body, name="3")  # a cancelled job is no longer active
        # A paused job holds no worker and no place in a queue: it does not count, but its
        # resume does, refused like a submit past the limit.
        assert client.post(f"/jobs/{third['id']}/pause", headers=alice).json()["status"] == "paused"
        fourth = submit(client, alice, body, name="4")
        refused = client.post(f"/jobs/{third['id']}/resume", headers=alice)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "30", refused.text
        assert client.get(f"/jobs/{third['id']}", headers=alice).json()["status"] == "paused"
        client.post(f"/jobs/{fourth['id']}/cancel", headers=alice)
        assert client.post(f"/jobs/{third['id']}/resume", headers=alice).json()["status"] == "queued"


# Postgres only: the per-owner lock is Postgres's (SQLite has one writer at a time and, as the
# embedded default, one user).
@pytest.mark.parametrize("empty_database_url", ["postgres"], indirect=True)
def test_concurrent_submits_do_not_pass_the_active_job_limit(
    database_url: str, monkeypatch: pytest.MonkeyPatch, body: dict[str, Any]
) -> None:
    from api.jobs_service import ActiveJobLimitError, create_job
    from shared.jobs.spec import JobCreate

    monkeypatch.setenv("TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER", "2")
    get_settings.cache_clear()
    settings = get_settings()
    job_in = JobCreate.model_validate(body)
    start = threading.Barrier(6)

    def submit_one(_: int) -> str:
        with Session(get_engine()) as session:
            start.wait()
            try:
                create_job(session=session, job_in=job_in.model_copy(deep=True), settings=settings, owner="alice")
                return "created"
            except ActiveJobLimitError:
                return "refused"

    with ThreadPoolExecutor(max_workers=6) as pool:
        outcomes = sorted(pool.map(submit_one, range(6)))
    assert outcomes == ["created"] * 2 + ["refused"] * 4
    with Session(get_engine()) as session:
        assert len(session.exec(select(Job).where(Job.owner == "alice")).all()) == 2


def test_a_body_past_the_limit_is_413_before_it_is_parsed(
    database_url: str, monkeypatch: pytest.MonkeyPatch, body: dict[str, Any]
) -> None:
    import json

    from api.main import create_app

    auth_on(monkeypatch, TUNEQ_MAX_REQUEST_BYTES="2000")
    with TestClient(create_app()) as client:
        alice = bearer(new_key("alice"))
        big = json.dumps({**body, "name": "x" * 2000}).encode()
        headers = {**alice, "content-type": "application/json"}
        answer = client.post("/jobs", content=big, headers=headers)
        assert answer.status_code == 413 and "larger than 2000 bytes" in answer.json()["detail"]
        # Streamed without a Content-Length: refused once the bytes pass the limit.
        chunked = client.post("/jobs", content=iter([big[:1500], big[1500:]]), headers=headers)
        assert chunked.status_code == 413, chunked.text
        # Even without a key (the limit comes first), and for any content type.
        assert client.post("/jobs", content=big, headers={"content-type": "text/plain"}).status_code == 413
        assert client.get("/jobs", headers=alice).json()["count"] == 0
        assert client.post("/jobs", json=body, headers=alice).status_code == 201


def test_without_auth_every_job_belongs_to_local(database_url: str, body: dict[str, Any]) -> None:
    from api.main import create_app

    assert get_settings().auth == "off"  # as the test fixtures run
    with TestClient(create_app()) as client:
        job = submit(client, {"Authorization": "Bearer whatever"}, body)
        assert job["owner"] == "local"
        assert client.get(f"/jobs/{job['id']}").status_code == 200


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# ---- real processes --------------------------------------------------------------------


def tuneq(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def process_env(**extra: str) -> dict[str, str]:
    keep = ("TUNEQ_HOME", "TUNEQ_DATABASE_URL")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEQ_") or k in keep}
    return {**env, **extra}


def test_keys_create_list_revoke(database_url: str, monkeypatch: pytest.MonkeyPatch, body: dict[str, Any]) -> None:
    from api.main import create_app

    env = process_env()
    created = tuneq("keys", "create", "--owner", "dana", env=env)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("tq_") and "\n" not in key
    key_id = key.split("_")[1]
    assert f"key {key_id} for owner dana" in created.stderr and key not in created.stderr

    listed = tuneq("keys", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["ID", "OWNER", "ADMIN", "CREATED", "LAST", "USED", "REVOKED"]
    assert row.split()[:3] == [key_id, "dana", "-"] and row.endswith("-") and key not in listed.stdout
    admin = tuneq("keys", "create", "--owner", "ops", "--admin", env=env)
    assert admin.returncode == 0 and "an admin's key" in admin.stderr, admin.stderr
    assert tuneq("keys", "list", env=env).stdout.splitlines()[2].split()[1:3] == ["ops", "yes"]

    # Keys looked up on every request: the CLI's revoke shows at once (within the default
    # TUNEQ_KEY_CACHE_SECONDS, as a revoked key is refused, is tested above).
    auth_on(monkeypatch, TUNEQ_KEY_CACHE_SECONDS="0")
    with TestClient(create_app()) as client:
        assert client.get("/jobs", headers=bearer(key)).status_code == 200
        revoked = tuneq("keys", "revoke", key_id, env=env)
        assert revoked.returncode == 0 and f"key {key_id} of owner dana is revoked" in revoked.stdout
        assert client.get("/jobs", headers=bearer(key)).status_code == 401
    row = tuneq("keys", "list", env=env).stdout.splitlines()[1]
    assert row.split()[1] == "dana" and not row.endswith("-") and "UTC" in row  # last used and revoked

    unknown = tuneq("keys", "revoke", "nope", env=env)
    assert unknown.returncode == 1 and unknown.stderr.strip() == "tuneq: no key nope (see `tuneq keys list`)"
    bad = tuneq("keys", "create", "--owner", "no spaces", env=env)
    assert bad.returncode == 1 and "invalid owner" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_off_loopback_without_auth_refuses_to_start(tuneq_home: Path) -> None:
    started = time.monotonic()
    refused = tuneq("serve", "--host", "0.0.0.0", "--port", str(free_port()), env=process_env(TUNEQ_AUTH="off"))
    assert refused.returncode == 1
    assert time.monotonic() - started < 30
    assert refused.stderr.strip().splitlines() == [
        "tuneq: TUNEQ_AUTH=off is allowed only when the API listens on loopback (127.0.0.1, ::1, localhost), "
        "not on 0.0.0.0: leave auth on and create keys with `tuneq keys create --owner NAME`"
    ]
    dev = tuneq("dev", "--host", "0.0.0.0", "--port", str(free_port()), env=process_env(TUNEQ_AUTH="off"))
    assert dev.returncode == 1 and "TUNEQ_AUTH=off is allowed only" in dev.stderr


def test_serve_off_loopback_requires_keys(tuneq_home: Path) -> None:
    port = free_port()
    log = tuneq_home / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "serve", "--host", "0.0.0.0", "--port", str(port)],
            env=process_env(),  # TUNEQ_AUTH unset: auto, so on off loopback
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, log.read_text()
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            answer = client.get("/jobs")
            assert answer.status_code == 401 and answer.headers["WWW-Authenticate"].startswith("Bearer")
            created = tuneq("keys", "create", "--owner", "erin", env=process_env())
            assert client.get("/jobs", headers=bearer(created.stdout.strip())).json() == {
                "data": [],
                "count": 0,
                "count_capped": False,
            }
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_last_used_at_is_written_at_most_once_a_resolution(
    app_client: TestClient, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A key's every look-up reads it; only the first of each LAST_USED_RESOLUTION writes it.
    from datetime import timedelta

    from shared.db import api_keys

    auth_on(monkeypatch, TUNEQ_KEY_CACHE_SECONDS="0")  # every request looks its key up
    with Session(get_engine()) as session:
        row, key = create_key(session=session, owner="dave")
    job_id = submit(app_client, bearer(key), body)["id"]

    def last_used() -> Any:
        with Session(get_engine()) as session:
            found = session.get(ApiKey, row.id)
            assert found is not None
            return found.last_used_at

    first = last_used()
    assert first is not None
    for _ in range(3):
        assert app_client.get(f"/jobs/{job_id}", headers=bearer(key)).status_code == 200
    assert last_used() == first
    monkeypatch.setattr(api_keys, "LAST_USED_RESOLUTION", timedelta(0))
    assert app_client.get(f"/jobs/{job_id}", headers=bearer(key)).status_code == 200
    assert last_used() > first


@pytest.mark.parametrize("auth", ["on", "off"])
def test_every_answer_gives_its_database_connection_back(
    database_url: str, monkeypatch: pytest.MonkeyPatch, body: dict[str, Any], auth: str
) -> None:
    # The request's session is opened and closed on the event loop; one that connected is
    # closed in a thread: whatever the answer (200, 404, 401, 422), no connection stays out.
    from api.main import create_app

    auth_on(monkeypatch, TUNEQ_AUTH=auth)
    with TestClient(create_app()) as client:
        headers = bearer(new_key("erin")) if auth == "on" else {}
        job_id = client.post("/jobs", json=body, headers=headers).json()["id"]
        pool = get_engine().pool
        answers = [
            client.get(f"/jobs/{job_id}", headers=headers).status_code,
            client.get(f"/jobs/{uuid.uuid4()}", headers=headers).status_code,
            client.get("/jobs/not-a-uuid", headers=headers).status_code,
            client.get("/jobs", headers=headers).status_code,
        ]
        if auth == "on":
            answers.append(client.get(f"/jobs/{job_id}", headers=bearer("tq_nope_nope")).status_code)
        assert answers == [200, 404, 422, 200] + ([401] if auth == "on" else [])
        assert pool.checkedout() == 0  # type: ignore[attr-defined]


def test_a_download_link_serves_one_file_without_a_key_until_it_expires(
    app_client: TestClient, alices_job: str, alice: dict[str, str], bob: dict[str, str]
) -> None:
    """What the dashboard's download links follow with keys on (a browser's link sends no key):
    POST /jobs/{id}/downloads makes a 10-minute link to one file; GET it needs no key, and
    resumes with Range."""
    made = app_client.post(f"/jobs/{alices_job}/downloads", json={"path": "train.log"}, headers=alice)
    assert made.status_code == 201, made.text
    url = made.json()["url"]
    assert url.startswith("/downloads/dl_") and made.json()["expires_at"]
    assert app_client.get(url).content == b"alice's secret log line\n"
    resumed = app_client.get(url, headers={"Range": "bytes=8-"})
    assert resumed.status_code == 206 and resumed.content == b"secret log line\n"
    # Another owner's job, a file the job does not have, a token nobody made: 404.
    assert app_client.post(f"/jobs/{alices_job}/downloads", json={"path": "train.log"}, headers=bob).status_code == 404
    missing = app_client.post(f"/jobs/{alices_job}/downloads", json={"path": "nope.bin"}, headers=alice)
    assert missing.status_code == 404 and "nope.bin" in missing.text
    assert app_client.get("/downloads/dl_madeup").status_code == 404
    assert app_client.post(f"/jobs/{alices_job}/downloads", json={"path": "train.log"}).status_code == 401
    # Expired: refused, saying how to get another.
    with Session(get_engine()) as session:
        for link in session.exec(select(DownloadLink)).all():
            link.expires_at = utcnow() - timedelta(seconds=1)
            session.add(link)
        session.commit()
    expired = app_client.get(url)
    assert expired.status_code == 404 and "expired" in expired.json()["detail"]
