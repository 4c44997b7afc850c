"""Helpers for tests that use the real services on this machine."""

from __future__ import annotations

import uuid

from sqlalchemy import text


def fresh_postgres_schema(url: str, *, prefix: str = "t") -> str:
    """A URL whose connections use a new, empty schema, so tests never see each other's rows."""
    import sqlalchemy

    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}options=-csearch_path%3D{schema}"
