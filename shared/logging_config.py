"""How the tuneq processes log: one root handler on stderr, text or JSON (``TUNEQ_LOG_FORMAT``)."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from shared.settings import Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        # One object per line; `extra={...}` fields (job_id, worker) become keys of their own,
        # so a collector can filter on them without parsing the message.
        return JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            timestamp=False,
        )
    return logging.Formatter(TEXT_FORMAT)


def configure_logging(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter(settings.log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    # Alembic announces its plugins and dialect at INFO on every start; tuneq logs what it migrates.
    if root.level > logging.DEBUG:
        logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
        # httpx logs every request at INFO: a line per poll of the demo or the client.
        logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
