"""Fuzz the real app from its own ``/openapi.json``: no 5xx, and every response is one the schema declares.

Schemathesis generates requests (valid and invalid) for every operation and sends them in process
to ``create_app()`` on a migrated database (SQLite and Postgres, like the other API tests).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis import Case
from schemathesis.checks import CheckFunction
from schemathesis.python import asgi
from schemathesis.schemas import BaseSchema
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    ignored_auth,
    positive_data_acceptance,
    unsupported_method,
)

from api.main import create_app


@pytest.fixture
def seeded_job(database_url: str, body: dict[str, Any]) -> str:
    """One real job, so that the `{job_id}` operations also answer for a row that exists, not only 404.

    It is cancelled at once: a job that has ended is one whose live streams (`follow=true` logs,
    `Accept: text/event-stream` events) finish by themselves instead of waiting for a worker.
    """
    client = TestClient(create_app())  # no lifespan: the database_url fixture has migrated the database
    created = client.post("/jobs", json=body)
    assert created.status_code == 201, created.text
    job_id: str = created.json()["id"]
    assert client.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    return job_id


@pytest.fixture
def app_client(database_url: str) -> Iterator[asgi.ASGIClient]:
    """Schemathesis's in-process client for a fresh app on this test's database, lifespan included."""
    with asgi.get_client(create_app()) as client:
        yield client
    # Schemathesis keeps each app's lifespan running until the process exits; end it with the test,
    # before the fixtures above drop this test's database and settings.
    asgi.shutdown_lifespans()


def _schema(*, keys_required: bool) -> BaseSchema:
    # The schema is the app's own (`/openapi.json` serves exactly `app.openapi()`); building it needs
    # no database, so it can happen at collection time, and each test sends its cases to its own app.
    loaded = schemathesis.openapi.from_dict(create_app().openapi())
    if not keys_required:
        # With TUNEQ_AUTH=off every caller is the owner `local` by design: no `Authorization` header is
        # generated (nor its absence counted as invalid data), and a made-up key is not refused.
        loaded.config.generation.update(with_security_parameters=False)
    # `/jobs/{job_id}/events/stream` is Server-Sent Events only: for an existing job that has not ended
    # it never finishes by itself, and schemathesis reads a stream until it ends (or a read timeout).
    # The same stream is fuzzed through `GET /jobs/{job_id}/events` (its `Accept: text/event-stream`
    # form, same handler code), where the seeded job has ended, so those streams finish.
    return loaded.exclude(path="/jobs/{job_id}/events/stream")


schema = _schema(keys_required=False)
schema_with_keys = _schema(keys_required=True)


def _is_uuid(value: object) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def _excluded_checks(case: Case, *, keys_required: bool) -> list[CheckFunction]:
    """Every check runs (no 5xx, declared status, content type, headers, body shape, invalid data
    refused, undeclared methods refused, bad keys refused) except where its premise does not hold."""
    excluded: list[CheckFunction] = [] if keys_required else [ignored_auth]  # see `_schema`
    if case.operation.path == "/jobs/plan":
        # `GET /jobs/plan` is not an undeclared method: it is `GET /jobs/{job_id}` with a malformed id,
        # rightly a 422 (or 401 without a key), where this check wants 405.
        excluded.append(unsupported_method)
    if case.operation.path == "/jobs":
        # Starlette answers a path served by two routes (`GET /jobs`, `POST /jobs`) with the `Allow` of
        # the first route only, so `OPTIONS /jobs` says `Allow: POST` and this check wants GET in it too.
        excluded.append(allow_header_conformance)
    if case.body is not None:
        # A schema-valid job body (POST /jobs, /jobs/plan) still names a model and a dataset that must
        # exist inside TUNEQ_ALLOWED_ROOTS, and a DeepSpeed config DeepSpeed accepts: no JSON Schema can
        # say so, so generated bodies are rightly refused with a 422 naming the field.
        excluded.append(positive_data_acceptance)
    return excluded


@schema.parametrize()
@schema.given(existing=st.booleans())
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_every_operation_answers_as_its_schema_says(
    case: Case, existing: bool, seeded_job: str, app_client: asgi.ASGIClient
) -> None:
    if existing and case.path_parameters and _is_uuid(case.path_parameters.get("job_id")):
        case.path_parameters["job_id"] = seeded_job  # a malformed id (a negative case) stays as generated
    if existing and case.path_parameters and "fine_tuning_job_id" in case.path_parameters:
        case.path_parameters["fine_tuning_job_id"] = "ftjob-" + uuid.UUID(seeded_job).hex  # the same job on /v1
    case.call_and_validate(
        session=app_client, base_url=app_client.base_url, excluded_checks=_excluded_checks(case, keys_required=False)
    )


@schema_with_keys.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_without_an_api_key_every_operation_answers_as_its_schema_says(
    case: Case, app_client: asgi.ASGIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same checks with API keys required and no valid one sent (none, or made-up ones): 401s."""
    from shared.settings import get_settings

    monkeypatch.setenv("TUNEQ_AUTH", "on")
    get_settings.cache_clear()
    case.call_and_validate(
        session=app_client, base_url=app_client.base_url, excluded_checks=_excluded_checks(case, keys_required=True)
    )


def test_the_fuzzed_schema_is_the_served_one_with_the_job_operations(tuneq_home: Path) -> None:
    """Guards the fuzz test against silently fuzzing nothing (a renamed path, an empty schema), and
    the exclusion above against going stale."""
    served = TestClient(create_app()).get("/openapi.json").json()
    assert served == create_app().openapi()
    assert {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/cancel", "/jobs/{job_id}/logs"} <= set(served["paths"])
    assert {
        "/v1/files",
        "/v1/fine_tuning/jobs",
        "/v1/fine_tuning/jobs/{fine_tuning_job_id}/events",
        "/v1/models",
    } <= set(served["paths"])
    assert "/jobs/{job_id}/events/stream" in served["paths"]


def test_the_largest_offsets_and_cursors_answer_and_larger_ones_are_422(seeded_job: str) -> None:
    """What the fuzzer found: `skip` / `after` / `Last-Event-ID` past a SQL INTEGER were a driver overflow
    (500) instead of a 422 naming the parameter."""
    from api.routes.jobs import SQL_INT_MAX

    client = TestClient(create_app())
    too_large = str(SQL_INT_MAX + 1)
    assert client.get("/jobs", params={"skip": SQL_INT_MAX}).json()["data"] == []
    assert client.get(f"/jobs/{seeded_job}/events", params={"after": SQL_INT_MAX}).json()["data"] == []
    for response, loc in [
        (client.get("/jobs", params={"skip": too_large}), ["query", "skip"]),
        (client.get(f"/jobs/{seeded_job}/events", params={"after": too_large}), ["query", "after"]),
        (client.get(f"/jobs/{seeded_job}/events", headers={"Last-Event-ID": too_large}), ["header", "last-event-id"]),
    ]:
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == loc


def _with(body: dict[str, Any], *path: str, raw: str) -> str:
    """``body`` as JSON with the value at ``path`` replaced by the raw JSON text ``raw``."""
    import json

    marker = "__tuneq_hostile__"
    copy = json.loads(json.dumps(body))
    node: Any = copy
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = marker
    return json.dumps(copy).replace(f'"{marker}"', raw)


# What a fuzzer of JSON Schema never sends, but a client (or an attacker) can: each was a 500
# and a dropped keep-alive connection before, or was accepted (a learning rate of infinity).
HOSTILE_BODIES = [
    ("nan", ("deepspeed_config", "train_batch_size"), "NaN", "not a finite number"),
    ("infinity", ("training", "learning_rate"), "Infinity", "not a finite number"),
    ("minus-infinity", ("training", "weight_decay"), "-Infinity", "not a finite number"),
    ("overflowing-float", ("training", "learning_rate"), "1e999", "not a finite number"),
    ("lone-surrogate", ("name",), '"\\ud800"', "lone UTF-16 surrogate"),
    ("lone-surrogate-key", ("deepspeed_config", "\udc00"), "1", "lone UTF-16 surrogate"),
    ("nul-byte", ("name",), '"a\\u0000b"', "NUL character"),
    ("nul-byte-deep", ("deepspeed_config", "optimizer"), '{"type": "Adam\\u0000W"}', "NUL character"),
    ("nested-5000", ("deepspeed_config", "x"), "[" * 5000 + "]" * 5000, "nested deeper than"),
    ("nested-40", ("deepspeed_config", "x"), '{"a": ' * 40 + "1" + "}" * 40, "nested deeper than"),
    ("curriculum_learning", ("deepspeed_config", "curriculum_learning"), '{"enabled": true}', "curriculum"),
    ("nebula", ("deepspeed_config", "nebula"), '{"enabled": true}', "Nebula"),
    ("elasticity", ("deepspeed_config", "elasticity"), '{"enabled": true}', "Elastic training has been removed"),
    ("compression_training", ("deepspeed_config", "compression_training"), "{}", "compression library"),
    ("switch-not-bool", ("deepspeed_config", "flops_profiler"), '{"enabled": "yes"}', "must be true or false"),
]


@pytest.mark.parametrize("operation", ["/jobs", "/jobs/plan"])
@pytest.mark.parametrize(("label", "path", "raw", "said"), HOSTILE_BODIES, ids=[case[0] for case in HOSTILE_BODIES])
def test_hostile_bodies_are_a_422_naming_the_place_and_leave_no_row(
    database_url: str, body: dict[str, Any], operation: str, label: str, path: tuple[str, ...], raw: str, said: str
) -> None:
    from sqlmodel import Session, func, select

    from shared.db.engine import get_engine
    from shared.db.models import Job

    client = TestClient(create_app(), raise_server_exceptions=False)
    content = _with(body, *path, raw=raw).encode("utf-8", "surrogatepass")
    response = client.post(operation, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    problem = response.json()["detail"][0]
    assert said in problem["msg"], problem
    assert problem["loc"][0] == "body", problem
    if not label.startswith("nested") and "surrogate-key" not in label:  # a surrogate key cannot be echoed
        assert problem["loc"][1 : 1 + len(path)] == list(path), problem
    with Session(get_engine()) as session:
        assert session.exec(select(func.count()).select_from(Job)).one() == 0
    # The same client's next request is answered: nothing above broke the connection or the app.
    # (A plan of the stand-in model is a 422 of its own: the model has no weights to count.)
    assert client.post(operation, json=body).status_code == (201 if operation == "/jobs" else 422)


# A NUL in a path, query or header parameter (issue 41) reached Postgres, which cannot hold one in text:
# psycopg's DataError, a 500 (an artifact's path, an Idempotency-Key, a `metadata[key]` filter), where
# SQLite answered 404 or 200. The fuzzer above runs on Postgres too but missed it: hypothesis draws each
# character from all of Unicode, so a NUL in one given parameter is a rare draw in 50 examples (none in
# 300 draws of an artifact's path), and `metadata[...]` is declared by no operation. So the sweep below
# puts one in every parameter of every operation, one at a time, with the others valid.
NUL_SWEEP_PATH_VALUES = {  # an operation with a path parameter not listed here fails the sweep
    "job_id": "{job_id}",
    "fine_tuning_job_id": "ftjob-{job_hex}",
    "file_id": "file-0123456789abcdef",
    "path": "model/model.safetensors",
    "model": "tiny-gpt-neo",
    "token": "dl_0123456789abcdef",
}
# Read by routes without being declared (`metadata[key]` of GET /v1/fine_tuning/jobs, the API key),
# or by none: a NUL there is refused all the same.
NUL_SWEEP_UNDECLARED = [("query", "metadata[team]"), ("header", "authorization"), ("header", "x-anything")]


def _nul_sweep(job_id: str) -> Iterator[tuple[str, str, tuple[str, str], dict[str, Any]]]:
    """(method, path template, (where, name), httpx arguments): a request per parameter of each
    operation of the served schema, with a NUL in that parameter."""
    valid = {
        name: value.format(job_id=job_id, job_hex=uuid.UUID(job_id).hex)
        for name, value in NUL_SWEEP_PATH_VALUES.items()
    }
    for template, operations in create_app().openapi()["paths"].items():
        for method, operation in operations.items():
            declared = [(p["in"], p["name"]) for p in operation.get("parameters", [])]
            for where, name in declared + NUL_SWEEP_UNDECLARED:
                path_values = {**valid, name: valid[name] + "\x00"} if where == "path" else valid
                nul = {name: "1\x00"}
                yield (
                    method.upper(),
                    template,
                    (where, name),
                    {
                        "url": template.format(**path_values).replace("\x00", "%00"),
                        "params": nul if where == "query" else None,
                        "headers": nul if where == "header" else None,
                    },
                )


def test_a_nul_in_any_path_query_or_header_parameter_is_refused_naming_it(
    database_url: str, seeded_job: str, body: dict[str, Any]
) -> None:
    """Every operation, on SQLite and Postgres: a 422 in FastAPI's shape naming the place on the native
    API, OpenAI's 400 naming the parameter on /v1 (how each answers a malformed parameter); never a 5xx."""
    client = TestClient(create_app(), raise_server_exceptions=False)
    server_errors: list[str] = []
    not_refused: list[str] = []
    for method, template, (where, name), arguments in _nul_sweep(seeded_job):
        # POSTs carry a valid job body, so that a NUL in their headers would reach SQL if let through.
        response = client.request(method, json=body if method == "POST" else None, **arguments)
        said = f"{method} {template} with a NUL in {where} {name!r}: {response.status_code} {response.text[:120]}"
        if response.status_code >= 500:
            server_errors.append(said)
        answer = response.json() if response.headers.get("content-type") == "application/json" else {}
        if template.startswith("/v1/"):
            refused = response.status_code == 400 and answer["error"]["param"] == (None if where == "path" else name)
        else:
            loc = [where] if where == "path" else [where, name]
            refused = response.status_code == 422 and answer["detail"][0]["loc"] == loc
        if not refused:
            not_refused.append(said)
    assert not server_errors, "\n".join(server_errors)
    assert not not_refused, "\n".join(not_refused)
    assert "NUL character" in client.get(f"/jobs/{seeded_job}/artifacts/model%00").json()["detail"][0]["msg"]
    assert "NUL character" in client.get("/v1/fine_tuning/jobs", params={"after": "\x00"}).json()["error"]["message"]
