"""A request body's unknown field, refused with the field the caller probably meant.

pydantic refuses a field a model forbids with "Extra inputs are not permitted", which names no
fix: ``training.max_step`` should say "did you mean 'max_steps'?", as a DeepSpeed config's
typos do (``shared.spelling``). The fields a body takes at an error's location come from the
route's body model, so this holds for every route, native and ``/v1`` alike.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Union, get_args, get_origin

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel

from shared.spelling import did_you_mean


def with_field_suggestions(request: Request, exc: RequestValidationError) -> RequestValidationError:
    """``exc`` with each unknown body field's message saying which field was meant (or which
    fields the object takes); ``exc`` itself when it has none or the route has no body model."""
    route = request.scope.get("route")
    body_field = route.body_field if isinstance(route, APIRoute) else None
    errors = list(exc.errors())
    if body_field is None or not any(e.get("type") == "extra_forbidden" for e in errors):
        return exc
    body_model = _model_in(body_field.field_info.annotation)
    if body_model is None:
        return exc
    rewritten = [_suggested(error, body_model) if error.get("type") == "extra_forbidden" else error for error in errors]
    return RequestValidationError(rewritten, body=exc.body)


def _suggested(error: dict[str, Any], body_model: type[BaseModel]) -> dict[str, Any]:
    loc = tuple(error.get("loc") or ())
    if len(loc) < 2 or loc[0] != "body" or not isinstance(loc[-1], str):
        return error
    model = _model_at(body_model, loc[1:-1])
    if model is None:
        return error
    known = [info.alias or name for name, info in model.model_fields.items()]
    unknown = loc[-1]
    where = ".".join(str(part) for part in loc[1:-1]) or "the body"
    hint = did_you_mean(unknown, known) or f"its fields are {', '.join(known)}"
    return {**error, "msg": f"{error.get('msg')}: {where} has no field '{unknown}'; {hint}"}


def _model_at(model: type[BaseModel], path: Sequence[Any]) -> type[BaseModel] | None:
    """The model of the object at ``path`` (field names, list indexes) inside ``model``."""
    current: type[BaseModel] | None = model
    for part in path:
        if current is None:
            return None
        if isinstance(part, int):
            continue  # an item of a list: the field's annotation named the items' model already
        field = next((f for name, f in current.model_fields.items() if part in (name, f.alias)), None)
        current = _model_in(field.annotation) if field is not None else None
    return current


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The one model an annotation holds: itself, or inside ``X | None`` or ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType, list):
        models = [m for m in (_model_in(arg) for arg in get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None
