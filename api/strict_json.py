"""Request bodies are checked as JSON every reader agrees on before anything reads them.

FastAPI parses bodies with Python's ``json``, which accepts more than JSON (RFC 8259) and more
than the rest of tuneq can keep, so a body is refused with a 422 naming the place when it has:

- a key twice in one object: Python keeps the last, other parsers the first, so a config that
  says ``"stage": 0`` and then ``"stage": 3`` means different things to different readers;
- ``NaN``, ``Infinity`` or ``-Infinity`` (not JSON), or a number too large for a float
  (``1e999``, which Python reads as infinity): a learning rate of infinity would train on garbage;
- a NUL character, a lone UTF-16 surrogate (``"\\ud800"``), or nesting deeper than
  ``MAX_DEPTH``: ``shared.json_values``' limits, which the records of data files get too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from shared.json_values import MAX_DEPTH, Loc, value_problem

TOO_DEEP = f"the body is nested deeper than {MAX_DEPTH} levels: no job field is"


@dataclass(frozen=True)
class BodyProblem:
    """Why a body is refused, and where in it (``loc`` starts with ``"body"``)."""

    loc: Loc
    message: str


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _NotANumber:
    """What ``NaN``/``Infinity`` parse to, so the walk below can say where they stand."""

    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> float | _NotANumber:
    value = float(text)
    return value if value - value == 0 else _NotANumber(text)  # 1e999 is infinity to Python


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _not_a_finite_number(item: object) -> str | None:
    return f"{item.text} is not a finite number: give a finite number" if isinstance(item, _NotANumber) else None


def body_problem(body: bytes) -> BodyProblem | None:
    """The first reason to refuse ``body``, or None (also for a body that is not JSON at all,
    which FastAPI reports itself)."""
    try:
        value = json.loads(body, object_pairs_hook=_refuse_duplicates, parse_constant=_NotANumber, parse_float=_number)
    except _DuplicateKey as e:
        return BodyProblem(("body",), f"the key '{e.key}' appears twice in one JSON object: give each key once")
    except RecursionError:
        return BodyProblem(("body",), TOO_DEEP)
    except ValueError:
        return None
    found = value_problem(value, leaf_problem=_not_a_finite_number)
    if found is None:
        return None
    loc: Loc = ("body", *found.loc)
    if found.kind == "too_deep":
        return BodyProblem(loc[:MAX_DEPTH], TOO_DEEP)
    return BodyProblem(loc, f"this string {found.message}" if found.kind == "string" else found.message)


def _parsed_as_json(content_type: str) -> bool:
    """Whether FastAPI parses a body with this content type as JSON (it does without one)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return not media or media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH") and _parsed_as_json(request.headers.get("content-type", "")):
                body = await request.body()  # cached for the handler
                if body and (problem := body_problem(body)) is not None:
                    # A validation error like pydantic's, so the app's handlers answer it as they
                    # answer those: a 422 on the native API, a 400 in OpenAI's envelope on /v1.
                    raise RequestValidationError(
                        [{"type": "value_error", "loc": list(problem.loc), "msg": problem.message}]
                    )
            return await handler(request)

        return strict_handler
