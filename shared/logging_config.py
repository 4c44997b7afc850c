"""How the tuneq processes log: one root handler on stderr, text or JSON (``TUNEQ_LOG_FORMAT``)."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from shared.settings import Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# An API process's lines say which request they are about (api.request_ids; "-": none).
API_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(correlation_id)s]: %(message)s"


class DeepSpeedAcceleratorGuess(logging.Filter):
    """Drops DeepSpeed's ``Setting accelerator to CPU. If you have GPU or other accelerator, we
    were unable to detect it.``: it says so in every tuneq process that imports DeepSpeed on a
    host without GPUs and without DS_ACCELERATOR (the API checking a submitted config, the demo
    saving its model through transformers). None of those runs ranks: a worker says what
    hardware it found itself (``worker ... ready: 2 cpu device(s)``), and its ranks get
    DS_ACCELERATOR (worker.launcher.rank_environment). DeepSpeed's other messages pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU.")


def log_formatter(log_format: str, *, request_ids: bool = False) -> logging.Formatter:
    if log_format == "json":
        # One object per line; `extra={...}` fields (job_id, worker) become keys of their own,
        # so a collector can filter on them without parsing the message.
        return JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            timestamp=False,
        )
    return logging.Formatter(API_TEXT_FORMAT if request_ids else TEXT_FORMAT)


def configure_logging(settings: Settings, *, request_ids: bool = False) -> None:
    """``request_ids``: an API process's, whose lines carry the request's id (in JSON, the key
    ``correlation_id``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter(settings.log_format, request_ids=request_ids))
    if request_ids:
        from asgi_correlation_id import CorrelationIdFilter

        handler.addFilter(CorrelationIdFilter(default_value="-"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    # DeepSpeed's logger has a handler of its own and does not propagate; it keeps this filter
    # when it sets itself up on import (deepspeed.utils.logging.LoggerFactory).
    deepspeed = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, DeepSpeedAcceleratorGuess) for f in deepspeed.filters):
        deepspeed.addFilter(DeepSpeedAcceleratorGuess())
    # Alembic announces its plugins and dialect at INFO on every start; tuneq logs what it migrates.
    if root.level > logging.DEBUG:
        logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
        # httpx logs every request at INFO: a line per poll of the demo or the client.
        logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
