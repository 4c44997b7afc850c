from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends
from sqlmodel import Session

from shared.db import get_engine
from shared.settings import Settings, get_settings


def get_session() -> Iterator[Session]:
    with Session(get_engine(), expire_on_commit=False) as session:
        yield session


# Closed when the route function returns, not when the response ends: an event stream or a
# followed log may stay open for hours, and must not hold a pooled connection all that time
# (it opens short sessions of its own). Routes return plain models, so nothing reads the
# session after the function.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings)]
