"""OpenAI's list pages: ``after`` names the last item of the page before, and the next page
holds the items past it in the list's order (by creation time, ties by id)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import Query
from pydantic import BeforeValidator, StringConstraints
from sqlalchemy import and_, or_
from sqlalchemy.sql.elements import ColumnElement


def _absent_when_empty(value: object) -> object:
    return None if value == "" else value


# A list's ``after``: an empty one (``?after=``, as a client with no cursor yet may send it) is
# no cursor, as OpenAI takes it.
After = Annotated[
    Annotated[str, StringConstraints(max_length=200)] | None,
    BeforeValidator(_absent_when_empty),
    Query(description="The id of the last item of the page before (empty: the first page)"),
]


def past_cursor(
    created: Any, ident: Any, *, cursor_created: datetime, cursor_id: Any, newest_first: bool
) -> ColumnElement[bool]:
    """Rows after the cursor row in ``(created, ident)`` order, descending when ``newest_first``.
    The cursor's values are its row's, read back from SQL, so both sides compare as SQL does."""
    if newest_first:
        return or_(created < cursor_created, and_(created == cursor_created, ident < cursor_id))
    return or_(created > cursor_created, and_(created == cursor_created, ident > cursor_id))
