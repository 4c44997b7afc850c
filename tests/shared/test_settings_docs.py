"""docs/settings.md is generated from shared/settings.py (shared.settings_docs) and must match it."""

from __future__ import annotations

import pytest

from shared import settings_docs
from shared.settings import Settings


def test_docs_settings_md_is_what_the_generator_writes() -> None:
    written = settings_docs.DOCS_PATH.read_text() if settings_docs.DOCS_PATH.exists() else ""
    assert written == settings_docs.settings_markdown(), (
        f"docs/settings.md is out of date with shared/settings.py: run `{settings_docs.REGENERATE_COMMAND}`"
    )


def test_every_setting_is_in_the_table_once() -> None:
    table = settings_docs.settings_markdown()
    for name in Settings.model_fields:
        assert table.count(f"| `TUNEQ_{name.upper()}` |") == 1, name


def test_meanings_come_from_descriptions_then_the_comments_above_each_field() -> None:
    source = """
class Settings(BaseSettings):
    home: Path = Field(default=Path("."), description="From the description.")
    # From a comment,
    # over two lines.
    queue: str = "tuneq"

    # Not this one: a blank line parts it from the field below.

    log_level: str = "INFO"
"""
    found = settings_docs.source_meanings(source)
    assert found == {"home": "From the description.", "queue": "From a comment, over two lines.", "log_level": ""}


def test_a_field_without_any_description_is_refused_naming_it() -> None:
    source = "class Settings:\n    auth: str = 'auto'\n"
    with pytest.raises(ValueError, match=r"Settings\.auth has no description: add a comment above it"):
        settings_docs.meanings(source)


def test_defaults_are_shown_as_configured() -> None:
    assert settings_docs.default_text("auth") == "`auto`"
    assert settings_docs.default_text("artifacts_presign") == "`false`"
    assert settings_docs.default_text("lease_ttl_seconds") == "`60`"
    assert settings_docs.default_text("database_url") == "empty"
