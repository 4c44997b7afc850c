"""A NUL character in a request's path, query string or headers is refused before any route runs.

Postgres cannot hold a NUL in text, not even to compare with: a NUL that reached a query (an
artifact's path, an ``Idempotency-Key``, a ``metadata[key]`` filter of ``/v1``) was psycopg's
``DataError``, a 500, where SQLite answered 404. No id, name, cursor, filter or key tuneq takes can
contain one, so the request itself is malformed. One check here covers every route, and the
parameters no route declares (``metadata[...]``, the API key), rather than one per parameter.

The answer is the one each API gives any malformed parameter, made by the app's own handler for
validation errors (``api.v1.errors.validation_error_response``): FastAPI's 422 naming the place on
the native API, OpenAI's 400 envelope naming the parameter under ``/v1``. Not a 404: the request
names nothing that could exist, and the answer says what to fix. Request bodies are checked by
``api.strict_json`` (JSON) and the upload's own parsing (files).
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from api.v1.errors import validation_error_response

NUL = "\x00"
NUL_BYTE = b"\x00"
REFUSAL = "contains a NUL character (%00 or \\u0000), which no value tuneq takes can hold: remove it"

Loc = tuple[str, ...]


def _nul_location(scope: Scope) -> Loc | None:
    """Where the request has a NUL: ``("path",)``, ``("query", name)`` or ``("header", name)``; or None."""
    if NUL in scope["path"]:  # already percent-decoded by the server
        return ("path",)
    query: bytes = scope["query_string"]
    if b"%00" in query or NUL_BYTE in query:  # most requests stop here, parsing nothing
        for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
            if NUL in name or NUL in value:
                return ("query", name)
    for name_bytes, value_bytes in scope["headers"]:
        if NUL_BYTE in value_bytes:
            return ("header", name_bytes.decode("latin-1"))
    return None


class NulRefusal:
    """ASGI middleware: a request with a NUL in its path, query or a header value is answered
    as a validation error at that place (module docstring), and never reaches a route."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (loc := _nul_location(scope)) is None:
            await self.app(scope, receive, send)
            return
        message = f"the path {REFUSAL}" if loc == ("path",) else REFUSAL
        problem = RequestValidationError([{"type": "value_error", "loc": list(loc), "msg": message}])
        response = await validation_error_response(Request(scope, receive), problem)
        await response(scope, receive, send)
