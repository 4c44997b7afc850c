"""Every answer carries a request id (X-Request-ID): made in OpenAI's shape, or taken from the
request when it is a safe one; the `openai` SDK reads it as its request_id."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from shared.logging_config import configure_logging
from shared.settings import get_settings

MADE = re.compile(r"req_[0-9a-f]{32}")


@pytest.fixture
def client(database_url: str) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app(), raise_server_exceptions=False) as c:
        yield c


def test_every_answer_has_a_request_id_made_or_taken(client: TestClient) -> None:
    answers = [
        client.get("/healthz"),
        client.get("/jobs"),
        client.get("/jobs/not-a-uuid"),  # a 422
        client.get("/v1/fine_tuning/jobs/ftjob-nope"),  # OpenAI's envelope
        client.post("/jobs", content=b"x" * (get_settings().max_request_bytes + 1)),  # refused before any route
    ]
    ids = [answer.headers["x-request-id"] for answer in answers]
    assert all(MADE.fullmatch(i) for i in ids) and len(set(ids)) == len(ids), ids
    # A caller's own id is kept, so one request can be traced across services.
    assert client.get("/healthz", headers={"X-Request-ID": "trace-42.a_b"}).headers["x-request-id"] == "trace-42.a_b"
    # One that could forge a log line, or is too long, is replaced.
    for bad in ("two words", "x" * 129):
        assert MADE.fullmatch(client.get("/healthz", headers={"X-Request-ID": bad}).headers["x-request-id"])


def test_the_sdk_sees_the_request_id_of_an_answer_and_of_an_error(client: TestClient) -> None:
    sdk = OpenAI(base_url=f"{client.base_url}/v1", api_key="local", http_client=client, max_retries=0)
    page = sdk.fine_tuning.jobs.with_raw_response.list()
    assert page.request_id is not None and MADE.fullmatch(page.request_id)
    with pytest.raises(openai.NotFoundError) as refused:
        sdk.fine_tuning.jobs.retrieve("ftjob-" + "0" * 32)
    assert refused.value.request_id is not None and MADE.fullmatch(refused.value.request_id)


@pytest.fixture
def api_logging() -> Iterator[list[str]]:
    """The API processes' logging (configure_logging with request ids), its lines collected;
    the test process's own handlers put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging(get_settings(), request_ids=True)
    handler = root.handlers[0]
    lines: list[str] = []
    handler.emit = lambda record: lines.append(handler.format(record))  # type: ignore[method-assign]
    try:
        yield lines
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_the_api_s_log_lines_name_their_request(database_url: str, api_logging: list[str]) -> None:
    from api.main import create_app

    app = create_app()

    @app.get("/logs-something")
    def logs_something() -> dict[str, str]:
        logging.getLogger("api.test").warning("something happened")
        return {}

    with TestClient(app) as client:
        client.get("/logs-something", headers={"X-Request-ID": "req-abc"})
    assert any("[req-abc]: something happened" in line for line in api_logging), api_logging
