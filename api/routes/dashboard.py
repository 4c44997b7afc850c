"""The web dashboard: ``/`` serves the page, ``/dashboard/<file>`` its script, styles and icon.

The files under ``api/dashboard/static/`` are built from ``dashboard/`` (TypeScript, Preact and
uPlot, bundled by esbuild: ``cd dashboard && npm ci && npm run build``) and committed, so neither
a running service nor ``pip install`` needs Node, and no CDN is needed: the dashboard works on a
host without internet. The page calls the same ``/jobs`` API as any client (with the key a user
pastes when auth is on), so these routes need no key themselves and stay out of the OpenAPI schema.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "dashboard" / "static"

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# A fixed set, read once, rather than a mounted directory: nothing but the built files can ever
# be served (no path tricks), and an APIRouter cannot carry a StaticFiles mount into the app.
FILES = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in MEDIA_TYPES} if STATIC_DIR.is_dir() else {}
# The files are small, and a stale copy after an upgrade could call routes that changed.
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


def _file(name: str) -> FileResponse:
    path = FILES.get(name)
    if path is None:
        raise HTTPException(status_code=404, detail=f"no dashboard file {name!r}")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=NO_CACHE)


@router.get("/")
def index() -> FileResponse:
    return _file("index.html")


@router.get("/favicon.ico")
def favicon() -> FileResponse:
    """The icon, for clients that ask for it here without reading the page's ``<link rel=icon>``."""
    return _file("favicon.svg")


@router.get("/dashboard/{name}")
def asset(name: str) -> FileResponse:
    return _file(name)
