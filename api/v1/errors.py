"""Errors on ``/v1`` in OpenAI's envelope, ``{"error": {"message", "type", "param", "code"}}``, with
OpenAI's statuses, so the SDK raises the exception a caller expects (``BadRequestError``,
``AuthenticationError``, ``NotFoundError``, ...) with a message that says what to fix.

Only paths under ``/v1`` answer this way; the native API keeps ``{"detail": ...}``. The app's
handlers (``install_error_handlers``) choose by the request's path, so a route's own errors, a
missing key, FastAPI's validation errors (400 here, never 422: OpenAI has no 422) and unknown
``/v1`` paths all come out in the envelope.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from api.unknown_fields import with_field_suggestions

PREFIX = "/v1"


def is_openai_path(path: str) -> bool:
    return path == PREFIX or path.startswith(f"{PREFIX}/")


class OpenAIError(BaseModel):
    message: str
    type: str  # "invalid_request_error" for the caller's mistakes, "server_error" for ours
    param: str | None  # the parameter at fault, when one is
    code: str | None


class OpenAIErrorPublic(BaseModel):
    """What every ``/v1`` error answers."""

    error: OpenAIError


def error(description: str) -> dict[str, Any]:
    """One entry of a ``/v1`` route's ``responses=``: an error answered in OpenAI's envelope."""
    return {"model": OpenAIErrorPublic, "description": description}


# Each refusal's code when the raise names none: stable per kind, so a client can branch on
# ``error.code`` (the SDK's ``BadRequestError.code``) as it can on OpenAI's.
DEFAULT_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}
# A validation problem's code by pydantic's error type (the rest are invalid_value).
_VALIDATION_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}
_TYPE_ERRORS = ("_type", "_parsing")  # int_type, string_type, dict_type, int_parsing, ...


def envelope(status_code: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body. The type follows the status as OpenAI's does: a 5xx is
    ``server_error``, the rest ``invalid_request_error``; ``code`` is the raise's, else the
    status's (``DEFAULT_CODES``: a 401 is ``invalid_api_key``)."""
    kind = "server_error" if status_code >= 500 else "invalid_request_error"
    code = code or DEFAULT_CODES.get(status_code, "server_error" if status_code >= 500 else "invalid_request")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_code(error_type: str) -> str:
    """The code of one validation problem: a missing or unknown parameter, a value of the wrong
    type, or a value out of bounds (``invalid_value``)."""
    if error_type in _VALIDATION_CODES:
        return _VALIDATION_CODES[error_type]
    return "invalid_type" if error_type.endswith(_TYPE_ERRORS) else "invalid_value"


class OpenAIHTTPException(HTTPException):
    """An error a ``/v1`` route raises that names OpenAI's ``param`` (and ``code``)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=status_code, detail=message, headers=headers)
        self.param = param
        self.code = code


class OpenAIRequestError(Exception):
    """A request a ``/v1`` service cannot serve: ``param`` names the parameter at fault as
    OpenAI's API would, ``status_code`` is the answer's (400 unless said). The handler
    ``install_error_handlers`` adds answers it in OpenAI's envelope, so routes need not catch it."""

    def __init__(self, message: str, *, param: str | None, status_code: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status_code = status_code
        self.code = code


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIRequestError)
    body = envelope(exc.status_code, str(exc), param=exc.param, code=exc.code)
    return JSONResponse(body, status_code=exc.status_code)


def _http_error_handler(openai_routes: Sequence[BaseRoute]) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if not is_openai_path(request.url.path):
            return await http_exception_handler(request, exc)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        headers = exc.headers
        if exc.status_code == 404 and not isinstance(exc, OpenAIHTTPException):
            message = f"{request.method} {request.url.path} is not a route of tuneq's OpenAI-compatible API"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
            # Starlette's Allow names the methods of the first route at the path only (POST of
            # POST /v1/files, not GET's); RFC 9110 wants every method the path takes.
            headers = {**(headers or {}), "Allow": ", ".join(_methods_at(openai_routes, request))}
        body = envelope(exc.status_code, message, param=getattr(exc, "param", None), code=getattr(exc, "code", None))
        return JSONResponse(body, status_code=exc.status_code, headers=headers)

    return http_error


def _methods_at(routes: Sequence[BaseRoute], request: Request) -> list[str]:
    methods: set[str] = set()
    for route in routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


# "body" is a form (POST /v1/files) or, for later routes, JSON: "field" fits both.
_PLACES = {"query": "query parameter", "path": "path parameter", "header": "header", "body": "field"}


async def validation_error_response(request: Request, exc: Exception) -> Response:
    """A validation error as the request's path answers one (the app's handler; also
    ``api.nul_refusal``'s answer, made before any route runs)."""
    assert isinstance(exc, RequestValidationError)
    exc = with_field_suggestions(request, exc)  # an unknown field says which one was meant
    if not is_openai_path(request.url.path):
        return await request_validation_exception_handler(request, exc)
    # The first problem, as OpenAI reports one: a sentence and the parameter it is about.
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    place = _PLACES.get(loc[0], loc[0]) if loc else "request"
    # The parameter's path as OpenAI names one: "method.supervised.hyperparameters.n_epochs".
    param = ".".join(loc[1:]) or None
    message = f"{place} {param}: {first.get('msg', 'is not valid')}" if param else first.get("msg", "")
    code = validation_code(str(first.get("type", "")))
    return JSONResponse(envelope(400, message, param=param, code=code), status_code=400)


def install_error_handlers(app: FastAPI, *, openai_routers: Sequence[APIRouter]) -> None:
    """Answer ``/v1`` errors in OpenAI's envelope and every other path's as FastAPI does.
    ``openai_routers``: the routers of ``/v1``, whose methods a 405's ``Allow`` lists."""
    routes = [route for router in openai_routers for route in router.routes]
    app.add_exception_handler(StarletteHTTPException, _http_error_handler(routes))
    app.add_exception_handler(RequestValidationError, validation_error_response)
    app.add_exception_handler(OpenAIRequestError, _request_error)
