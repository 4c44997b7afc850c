"""The error answers the API gives, declared once so each route's OpenAPI lists what it can return.

Every error that is not a 422 is ``{"detail": "<what went wrong, and what to do>"}`` (FastAPI's
``HTTPException``, and the 413 of :class:`api.auth.BodySizeLimit`); 422s keep FastAPI's own
validation shape, which FastAPI declares by itself.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

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
