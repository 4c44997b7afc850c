"""Who is asking: the owner behind ``Authorization: Bearer <key>`` (and whether the key is an
admin's), and the request body limit.

With ``TUNEQ_AUTH=off`` (allowed only on loopback, see ``tuneq serve``) every request is the
fixed owner ``local``, not an admin. Otherwise a missing, unknown or revoked key is 401.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.openapi.models import HTTPBearer as HTTPBearerModel
from fastapi.security.base import SecurityBase
from sqlmodel import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response
from api.read_cache import ReadCache
from shared.db.api_keys import hash_key, holder_of_key
from shared.db.engine import get_engine
from shared.db.models import LOCAL_OWNER
from shared.settings import Settings, get_settings


def _unauthorized(message: str, *, invalid: bool) -> HTTPException:
    challenge = 'Bearer error="invalid_token"' if invalid else "Bearer"
    return HTTPException(status_code=401, detail=message, headers={"WWW-Authenticate": challenge})


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is from: an owner, and whether its key is an admin's (``tuneq keys create
    --admin``), which sees and changes every owner's jobs."""

    owner: str
    admin: bool = False

    def sees(self, owner: str) -> bool:
        """Whether this caller may read (and cancel, pause, resume) ``owner``'s jobs."""
        return self.admin or owner == self.owner


LOCAL_CALLER = Caller(owner=LOCAL_OWNER)


def _caller_of_key(key: str) -> Caller | None:
    with Session(get_engine(), expire_on_commit=False) as session:
        row = holder_of_key(session=session, key=key)
        return Caller(owner=row.owner, admin=row.admin) if row is not None else None


class BearerScheme(SecurityBase):
    """What every route takes as a dependency: the caller (``BearerCaller``) or its owner
    (``BearerOwner``), from ``Authorization: Bearer <key>``.

    A security scheme itself (FastAPI declares it in the OpenAPI document, so clients and fuzzers
    know a 401 means "send a key") rather than a function over ``HTTPBearer``: a sub-dependency
    costs FastAPI's dependency solving on every request, about a fifth of a cached
    ``GET /jobs/{id}`` (BENCHMARKS.md, B4). It takes no session or settings dependency either,
    and opens a session only to look a key up that this process has not seen valid within
    ``TUNEQ_KEY_CACHE_SECONDS``. The header is read here, for refusals that say what is wrong
    with it.
    """

    def __init__(self) -> None:
        self.model = HTTPBearerModel(description="An API key: `tuneq keys create --owner NAME`")
        self.scheme_name = "HTTPBearer"

    async def caller(self, request: Request) -> Caller:
        settings = get_settings()
        if not settings.auth_required:
            return LOCAL_CALLER
        header = request.headers.get("authorization")
        if not header:
            raise _unauthorized(
                "this API needs a key: send 'Authorization: Bearer <key>' (an operator creates keys with "
                "`tuneq keys create --owner NAME`)",
                invalid=False,
            )
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("the Authorization header must be 'Bearer <key>'", invalid=False)
        key = key.strip()
        # The look-up reads (and now and then writes) the database, in the thread pool; a valid
        # key's caller is kept TUNEQ_KEY_CACHE_SECONDS by the SHA-256 of the key (api.read_cache),
        # so a revoked key is refused within that. Unknown and revoked keys are never kept.
        callers: ReadCache[str, Caller] = request.app.state.key_cache
        caller = await callers.read(hash_key(key), ttl=settings.key_cache_seconds, load=lambda _: _caller_of_key(key))
        if caller is None:
            raise _unauthorized("the API key is unknown or revoked", invalid=True)
        return caller


class BearerCaller(BearerScheme):
    """The caller, for the routes that read or change a job, which an admin's key may do for
    every owner's."""

    async def __call__(self, request: Request) -> Caller:
        return await self.caller(request)


class BearerOwner(BearerScheme):
    """The caller's owner alone, for the routes where an admin's key acts as its own owner's
    (submits, uploads, /v1)."""

    async def __call__(self, request: Request) -> str:
        return (await self.caller(request)).owner


current_caller = BearerCaller()
CallerDep = Annotated[Caller, Depends(current_caller)]
current_owner = BearerOwner()
OwnerDep = Annotated[str, Depends(current_owner)]


def _too_large_message(limit: int, *, upload: bool, settings: Settings) -> str:
    if upload:
        return (
            f"the request body is larger than {limit} bytes: a file may be at most {settings.max_upload_bytes} "
            "bytes (TUNEQ_MAX_UPLOAD_BYTES)"
        )
    return f"the request body is larger than {limit} bytes, the most this API reads (TUNEQ_MAX_REQUEST_BYTES)"


class _BodyTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body reading passes it on as the 413 it is."""

    def __init__(self, message: str) -> None:
        super().__init__(status_code=413, detail=message)


class BodySizeLimit:
    """Answer 413 for a request body over ``TUNEQ_MAX_REQUEST_BYTES``, before anything parses it:
    at once from Content-Length, else (chunked) as soon as the streamed bytes pass the limit.

    A POST to one of ``upload_paths`` (``POST /v1/files``) may carry a file of up to
    ``TUNEQ_MAX_UPLOAD_BYTES`` plus the rest of a form (``TUNEQ_MAX_REQUEST_BYTES``); the route
    holds the file itself to the exact limit as it reads it. The 413 is in the shape the path
    speaks (``api.errors.error_response``)."""

    def __init__(self, app: ASGIApp, upload_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.upload_paths = upload_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = get_settings()
        upload = scope["method"] == "POST" and scope["path"] in self.upload_paths
        limit = settings.max_request_bytes + (settings.max_upload_bytes if upload else 0)

        def refusal() -> str:  # made only for a refusal: most requests never need it
            return _too_large_message(limit, upload=upload, settings=settings)

        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_large = int(value) > limit
                except ValueError:
                    too_large = False
                if too_large:
                    await error_response(scope["path"], 413, refusal())(scope, receive, send)
                    return
            elif name == b"transfer-encoding":
                chunked = True
        if not chunked:
            # HTTP/1.1: a request with neither header has no body, and the server delivers exactly
            # a declared Content-Length; only a chunked body has to be counted as it comes. Most
            # requests are GETs, which then skip the two wrappers below.
            await self.app(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(refusal())
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if started:
                raise
            await error_response(scope["path"], 413, refusal())(scope, receive, send)
