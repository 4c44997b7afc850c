"""A request id on every response (``X-Request-ID``), logged with what the request logs.

An incoming ``X-Request-ID`` of up to 128 letters, digits and ``._-`` is kept (a proxy's or a
client's own, for tracing one request across services); otherwise a new one is made in OpenAI's
shape, ``req_`` and 32 hex digits, which the ``openai`` SDK shows as ``response._request_id``.
``asgi-correlation-id`` carries it through the request's context; ``shared.logging_config`` puts
it on the API processes' log lines.
"""

from __future__ import annotations

import re
import uuid

from asgi_correlation_id import CorrelationIdMiddleware
from fastapi import FastAPI

REQUEST_ID_HEADER = "X-Request-ID"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def is_request_id(value: str) -> bool:
    """Whether an incoming id may be kept: short, and nothing a log line could be forged with."""
    return _REQUEST_ID.fullmatch(value) is not None


def add_request_ids(app: FastAPI) -> None:
    """Give every response of ``app`` a request id: add it as the outermost middleware so that
    413s, 503s and the errors of every other middleware carry one too."""
    app.add_middleware(
        CorrelationIdMiddleware,
        header_name=REQUEST_ID_HEADER,
        update_request_header=True,
        generator=new_request_id,
        validator=is_request_id,
        transformer=None,
    )
