"""Request bodies are checked as JSON every reader agrees on before anything reads them.

FastAPI parses bodies with Python's ``json``, which accepts more than JSON (RFC 8259) and more
than the rest of tuneq can keep, so a body is refused with a 422 naming the place when it has:

- a key twice in one object: Python keeps the last, other parsers the first, so a config that
  says ``"stage": 0`` and then ``"stage": 3`` means different things to different readers;
- ``NaN``, ``Infinity`` or ``-Infinity`` (not JSON), or a number too large for a float
  (``1e999``, which Python reads as infinity): a learning rate of infinity would train on garbage;
- a NUL character, which Postgres cannot store in text, or a lone UTF-16 surrogate
  (``"\\ud800"``), which is no character at all and cannot be encoded as UTF-8;
- nesting deeper than ``MAX_DEPTH``: no field of a job is nested that deep, and a parser's
  recursion (Python's or pydantic's) should never be what refuses a request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

# A DeepSpeed config is about 4 levels deep inside a job body; 32 leaves plenty of room.
MAX_DEPTH = 32

TOO_DEEP = f"the body is nested deeper than {MAX_DEPTH} levels: no job field is"

Loc = tuple[str | int, ...]


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


def text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "contains a NUL character (\\u0000), which cannot be stored: remove it"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone UTF-16 surrogate (such as \\ud800), which is not a character: send valid Unicode"
    return None


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
    # Iteratively, depth first: a body nested thousands deep must not recurse here either.
    pending: list[tuple[Loc, Any]] = [(("body",), value)]
    while pending:
        loc, item = pending.pop()
        if len(loc) > MAX_DEPTH + 1:
            return BodyProblem(loc[:MAX_DEPTH], TOO_DEEP)
        if isinstance(item, _NotANumber):
            return BodyProblem(loc, f"{item.text} is not a finite number: give a finite number")
        if isinstance(item, str):
            if (problem := text_problem(item)) is not None:
                return BodyProblem(loc, f"this string {problem}")
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if (problem := text_problem(key)) is not None:
                    return BodyProblem((*loc, key.encode("utf-8", "replace").decode()), f"this key {problem}")
                pending.append(((*loc, key), child))
        elif isinstance(item, list):
            pending.extend(((*loc, index), child) for index, child in reversed(list(enumerate(item))))
    return None


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
