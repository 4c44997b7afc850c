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
    assert 'src="/dashboard/app.js"' in response.text
    assert 'href="/dashboard/app.css"' in response.text
    assert 'rel="icon" href="/dashboard/favicon.svg"' in response.text


@pytest.mark.parametrize(
    ("name", "media_type", "marker"),
    [
        ("app.js", "text/javascript", "/events/stream"),  # the live charts' event stream
        ("app.css", "text/css", ".uplot"),  # uPlot's styles, bundled with the page's
        ("favicon.svg", "image/svg+xml", "<svg"),
    ],
)
def test_static_files_are_served(client: TestClient, name: str, media_type: str, marker: str) -> None:
    response = client.get(f"/dashboard/{name}")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(media_type)
    assert response.headers["cache-control"] == "no-cache"
    assert marker in response.text


def test_favicon_ico_is_the_icon(client: TestClient) -> None:
    # Browsers and tools that ask /favicon.ico get the icon, not a 404 in the console.
    response = client.get("/favicon.ico")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("image/svg+xml")


@pytest.mark.parametrize(
    "name", ["missing.js", "..%2Fmain.py", "%2E%2E%2Froutes%2Fdashboard.py", "dashboard.js", "..%2F..%2Fmain.py"]
)
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
    assert client.get("/dashboard/app.js").status_code == 200
    assert client.get("/favicon.ico").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and "/favicon.ico" not in paths and not any(p.startswith("/dashboard") for p in paths)
