"""The dashboard's files are served without a key and stay out of the OpenAPI schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient


@pytest.fixture
def client(tuneq_home: Path) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:
        yield c


def test_root_serves_the_dashboard_page(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert 'src="/dashboard/dashboard.js"' in response.text
    assert 'id="loss-chart"' in response.text and 'id="lr-chart"' in response.text
    assert 'id="nodes-table"' in response.text  # a multi-node job's nodes (dashboard.js renderNodes)
    assert 'id="rewards-chart"' in response.text and 'id="accuracy-chart"' in response.text  # a DPO job's


@pytest.mark.parametrize(
    ("name", "media_type", "marker"),
    [("dashboard.js", "text/javascript", "readEvents"), ("dashboard.css", "text/css", "svg.chart")],
)
def test_static_files_are_served(client: TestClient, name: str, media_type: str, marker: str) -> None:
    response = client.get(f"/dashboard/{name}")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(media_type)
    assert marker in response.text


@pytest.mark.parametrize("name", ["missing.js", "..%2Fmain.py", "%2E%2E%2Froutes%2Fdashboard.py"])
def test_only_the_dashboard_files_are_served(client: TestClient, name: str) -> None:
    assert client.get(f"/dashboard/{name}").status_code == 404


def test_the_dashboard_needs_no_key_and_is_not_in_the_schema(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.settings import get_settings

    monkeypatch.setenv("TUNEQ_AUTH", "on")
    get_settings.cache_clear()
    assert client.get("/jobs").status_code == 401  # the page then asks for a key
    assert client.get("/").status_code == 200
    assert client.get("/dashboard/dashboard.js").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/dashboard") for p in paths)
