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

from api.auth import BodySizeLimit, Caller
from api.errors import unavailable_response
from api.jobs_service import JobAnswer
from api.metrics import RequestLatency, build_registry
from api.nul_refusal import NulRefusal
from api.plan_service import shutdown_plan_executor
from api.read_cache import ReadCache
from api.request_ids import add_request_ids
from api.routes import dashboard, downloads, health, jobs, workers
from api.server_stop import ServerStop, UnavailableWhileStopping
from api.v1 import files as v1_files
from api.v1 import fine_tuning as v1_fine_tuning
from api.v1 import models as v1_models
from api.v1.errors import install_error_handlers
from shared.artifacts.store import ArtifactStoreError
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


# After uvicorn's stop grace: how long the requests it cancelled get to send their 503s.
REQUESTS_END_SECONDS = 5.0


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    init_db()
    threading.Thread(target=_warm_deepspeed_parser, name="warm-deepspeed", daemon=True).start()
    yield
    # uvicorn cancelled what its stop's grace cut off just before this; those requests answer
    # 503 once they have unwound (api.server_stop), which must happen before the process ends.
    await app.state.server_stop.requests_ended(timeout=REQUESTS_END_SECONDS)
    shutdown_plan_executor()


async def _database_unavailable(request: Request, error: Exception) -> Response:
    """A database restart or a network blip is a 503 the client retries, not a 500 (and not a
    dropped connection); any other database error is still a 500, ours to fix."""
    if not is_transient_database_error(error):
        raise error
    logger.warning("%s %s: the database is unreachable: %s", request.method, request.url.path, error)
    return unavailable_response(
        request.url.path, "the database is unreachable for a moment: retry after the Retry-After seconds"
    )


async def _store_unavailable(request: Request, error: Exception) -> Response:
    """The artifact store could not be read (a job's model naming another job's output reads
    that model's config from it): a 503 the client retries, as for the database."""
    logger.warning("%s %s: the artifact store is unreachable: %s", request.method, request.url.path, error)
    return unavailable_response(request.url.path, f"{error}: retry after the Retry-After seconds")


def create_app() -> FastAPI:
    app = FastAPI(title="tuneq", version="0.1.0", lifespan=lifespan)
    app.add_exception_handler(DBAPIError, _database_unavailable)
    app.add_exception_handler(ArtifactStoreError, _store_unavailable)
    install_error_handlers(
        app, openai_routers=[v1_files.router, v1_fine_tuning.router, v1_models.router]
    )  # OpenAI's envelope on /v1
    # TUNEQ_MAX_REQUEST_BYTES (TUNEQ_MAX_UPLOAD_BYTES for a file upload), before any route reads the body.
    app.add_middleware(BodySizeLimit, upload_paths=frozenset({v1_files.UPLOAD_PATH}))
    # A NUL in the path, query or a header: a 422 (a 400 on /v1) before any route, not Postgres's DataError.
    app.add_middleware(NulRefusal)
    # Per app, not the process-global registry: tests build many apps in one process.
    app.state.metrics_registry, latency = build_registry()
    # Recent reads requests share (api.read_cache), per app like the registry: GET /jobs/{id}'s
    # answers by job id, and owners by the SHA-256 of their API key.
    app.state.job_cache = ReadCache[uuid.UUID, JobAnswer]()
    app.state.key_cache = ReadCache[str, Caller]()
    # 503 + Retry-After once the server stops (`tuneq serve` begins it on SIGTERM), and for what
    # the stop's grace cuts off, rather than a dropped connection.
    app.state.server_stop = ServerStop()
    app.add_middleware(UnavailableWhileStopping, stop=app.state.server_stop)
    app.add_middleware(RequestLatency, histogram=latency)  # times 413s and 503s too
    add_request_ids(app)  # outermost: every answer has an X-Request-ID
    # The job routes first: a request is matched against the routers in this order, and polls
    # of /jobs/... far outnumber probes of /healthz, /readyz and /metrics (paths do not overlap).
    app.include_router(jobs.router)
    app.include_router(workers.router)
    app.include_router(downloads.router)
    app.include_router(v1_files.router)
    app.include_router(v1_fine_tuning.router)
    app.include_router(v1_models.router)
    app.include_router(health.router)
    app.include_router(dashboard.router)  # the web UI at /, outside the OpenAPI schema
    return app


app = create_app()
