"""The web dashboard: ``/`` serves the page, ``/dashboard/<file>`` its script and styles.

Plain files with no build step and no CDN, so the dashboard works on a host without internet.
The page calls the same ``/jobs`` API as any client (with the key a user pastes when auth is on),
so these routes need no key themselves and stay out of the OpenAPI schema.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboard"

# A fixed list rather than a mounted directory: nothing but these files can ever be served
# (no path tricks), and an APIRouter cannot carry a StaticFiles mount into the app.
MEDIA_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# The files are tiny, and a stale copy after an upgrade could call routes that changed.
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> FileResponse:
    return FileResponse(DASHBOARD_DIR / name, media_type=MEDIA_TYPES[name], headers=NO_CACHE)


@router.get("/")
def index() -> FileResponse:
    return _file("index.html")


@router.get("/dashboard/{name}")
def asset(name: str) -> FileResponse:
    if name not in MEDIA_TYPES:
        raise HTTPException(status_code=404, detail=f"no dashboard file {name!r}")
    return _file(name)
