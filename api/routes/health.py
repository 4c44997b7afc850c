from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text

from api.metrics import exposition
from shared.db.engine import get_engine
from shared.queue import broker_reachable

logger = logging.getLogger(__name__)
router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz() -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as e:
        logger.warning("database not reachable: %s", e)
        checks["database"] = "unreachable"
    checks["broker"] = "ok" if broker_reachable() else "unreachable"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks}, status_code=200 if ready else 503
    )


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request) -> Response:
    """Prometheus exposition: jobs by status, queue depth, workers, steps/s per running job,
    API latency. Counts only, no job contents, so it asks for no key (scrapers rarely carry one)."""
    body, content_type = exposition(request.app.state.metrics_registry)
    return Response(body, media_type=content_type)
