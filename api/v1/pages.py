"""OpenAI's list pages: ``after`` names the last item of the page before, and the next page
holds the items past it in the list's order (by creation time, ties by id)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_
from sqlalchemy.sql.elements import ColumnElement


def past_cursor(
    created: Any, ident: Any, *, cursor_created: datetime, cursor_id: Any, newest_first: bool
) -> ColumnElement[bool]:
    """Rows after the cursor row in ``(created, ident)`` order, descending when ``newest_first``.
    The cursor's values are its row's, read back from SQL, so both sides compare as SQL does."""
    if newest_first:
        return or_(created < cursor_created, and_(created == cursor_created, ident < cursor_id))
    return or_(created > cursor_created, and_(created == cursor_created, ident > cursor_id))
