"""Request bodies with duplicate JSON keys are refused before anything reads them.

Python's json keeps the last of two equal keys silently, other parsers keep the first: a
config that says ``"stage": 0`` and then ``"stage": 3`` means different things to different
readers, so tuneq accepts neither.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute


class DuplicateKeyError(ValueError):
    pass


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKeyError(key)
        seen[key] = value
    return seen


def duplicate_key(body: bytes) -> str | None:
    """The first key that appears twice in one JSON object, or None (also for invalid JSON,
    which FastAPI reports itself)."""
    try:
        json.loads(body, object_pairs_hook=_refuse_duplicates)
    except DuplicateKeyError as e:
        return str(e)
    except ValueError:
        return None
    return None


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            if request.headers.get("content-type", "").startswith("application/json"):
                key = duplicate_key(await request.body())  # the body is cached for the handler
                if key is not None:
                    message = f"the key '{key}' appears twice in one JSON object: give each key once"
                    return JSONResponse(
                        status_code=422, content={"detail": [{"type": "value_error", "loc": ["body"], "msg": message}]}
                    )
            return await handler(request)

        return strict_handler
