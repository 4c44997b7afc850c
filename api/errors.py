"""The error answers the API gives, declared once so each route's OpenAPI lists what it can return.

Every error of the native API that is not a 422 is ``{"detail": "<what went wrong, and what to
do>"}`` (FastAPI's ``HTTPException``, and the 413 of :class:`api.auth.BodySizeLimit`); 422s keep
FastAPI's own validation shape, which FastAPI declares by itself. The OpenAI-compatible API under
``/v1`` answers in OpenAI's envelope instead (``api.v1.errors``).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from api.v1.errors import envelope, is_openai_path

# What a route's `responses=` takes.
Responses = dict[int | str, dict[str, Any]]


class ErrorPublic(BaseModel):
    detail: str


def error(description: str) -> dict[str, Any]:
    """One entry of a route's ``responses=``: an error answered as :class:`ErrorPublic`."""
    return {"model": ErrorPublic, "description": description}


NOT_FOUND: Responses = {404: error("No job with this id (or one another owner submitted)")}
# A body FastAPI cannot decode (not UTF-8) is its 400; malformed JSON is a 422 like any other mistake.
BODY_ERRORS: Responses = {
    400: error("The request body could not be read (it is not UTF-8 JSON)"),
    413: error("The request body is over TUNEQ_MAX_REQUEST_BYTES"),
}
UNAUTHORIZED: Responses = {401: error("No API key, or an unknown or revoked one")}

# How long a client waits before retrying a 503: the database back from a restart, or another
# replica (or the restarted server) answering for one that stopped.
UNAVAILABLE_RETRY_AFTER_SECONDS = 5


def error_response(path: str, status_code: int, message: str, *, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answered outside a route (a middleware, a database outage), in the shape the
    request's path speaks: OpenAI's envelope under ``/v1``, ``{"detail": ...}`` elsewhere."""
    content = envelope(status_code, message) if is_openai_path(path) else {"detail": message}
    return JSONResponse(content, status_code=status_code, headers=headers)


def unavailable_response(path: str, message: str) -> JSONResponse:
    """A 503 with ``Retry-After``, which clients retry (``tuneq``'s commands, the harness, load
    balancers): what the API answers while it cannot serve for a moment (the database is away,
    the server is stopping), rather than a 500 or a dropped connection."""
    return error_response(path, 503, message, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)})
