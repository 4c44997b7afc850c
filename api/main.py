"""The FastAPI app. ``uvicorn api.main:app`` or ``tuneq serve``."""

from __future__ import annotations

import gc
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from sqlalchemy.exc import DBAPIError

from api.auth import BodySizeLimit
from api.errors import error_response
from api.jobs_service import JobAnswer
from api.metrics import RequestLatency, build_registry
from api.plan_service import shutdown_plan_executor
from api.read_cache import ReadCache
from api.routes import dashboard, health, jobs
from api.v1 import files as v1_files
from api.v1 import fine_tuning as v1_fine_tuning
from api.v1 import models as v1_models
from api.v1.errors import install_error_handlers
from shared.db.engine import init_db, is_transient_database_error
from shared.deepspeed.config import known_top_level_keys

logger = logging.getLogger(__name__)


def _warm_deepspeed_parser() -> None:
    # The first submit would otherwise wait seconds for DeepSpeed (and torch) to import;
    # doing it off the request path keeps start-up fast and the first submit quick.
    try:
        known_top_level_keys()
    except Exception:
        logger.exception("could not import DeepSpeed's config parser")
    # The import left ~200 000 objects that live as long as the process. Each of the cyclic
    # GC's full collections would walk them all with the GIL held (~0.1 s, more on a busy host:
    # B4's first burst had a 250 ms p99 from it). Frozen after one last collection (so no
    # garbage is kept), they are never scanned again.
    gc.collect()
    gc.freeze()


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    init_db()
    threading.Thread(target=_warm_deepspeed_parser, name="warm-deepspeed", daemon=True).start()
    yield
    shutdown_plan_executor()


DATABASE_RETRY_AFTER_SECONDS = 5


async def _database_unavailable(request: Request, error: Exception) -> Response:
    """A database restart or a network blip is a 503 the client retries, not a 500 (and not a
    dropped connection); any other database error is still a 500, ours to fix."""
    if not is_transient_database_error(error):
        raise error
    logger.warning("%s %s: the database is unreachable: %s", request.method, request.url.path, error)
    return error_response(
        request.url.path,
        503,
        "the database is unreachable for a moment: retry after the Retry-After seconds",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_SECONDS)},
    )


def create_app() -> FastAPI:
    app = FastAPI(title="tuneq", version="0.1.0", lifespan=lifespan)
    app.add_exception_handler(DBAPIError, _database_unavailable)
    install_error_handlers(
        app, openai_routers=[v1_files.router, v1_fine_tuning.router, v1_models.router]
    )  # OpenAI's envelope on /v1
    # TUNEQ_MAX_REQUEST_BYTES (TUNEQ_MAX_UPLOAD_BYTES for a file upload), before any route reads the body.
    app.add_middleware(BodySizeLimit, upload_paths=frozenset({v1_files.UPLOAD_PATH}))
    # Per app, not the process-global registry: tests build many apps in one process.
    app.state.metrics_registry, latency = build_registry()
    # Recent reads requests share (api.read_cache), per app like the registry: GET /jobs/{id}'s
    # answers by job id, and owners by the SHA-256 of their API key.
    app.state.job_cache = ReadCache[uuid.UUID, JobAnswer]()
    app.state.key_cache = ReadCache[str, str]()
    app.add_middleware(RequestLatency, histogram=latency)  # outermost: times 413s too
    # The job routes first: a request is matched against the routers in this order, and polls
    # of /jobs/... far outnumber probes of /healthz, /readyz and /metrics (paths do not overlap).
    app.include_router(jobs.router)
    app.include_router(v1_files.router)
    app.include_router(v1_fine_tuning.router)
    app.include_router(v1_models.router)
    app.include_router(health.router)
    app.include_router(dashboard.router)  # the web UI at /, outside the OpenAPI schema
    return app


app = create_app()
