"""The worker's Celery setup (worker/tasks.py): the queues it consumes, and what Celery prints at
its start."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from celery.exceptions import SecurityWarning
from celery.platforms import check_privileges

from shared.jobs.hardware import Hardware
from shared.settings import get_settings
from worker import tasks


def test_a_cpu_workers_size_queue_is_named_by_its_devices_not_as_gpus(
    tuneq_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker of 2 CPU cores consumed `tuneq-2gpu`, as the banner of `tuneq dev` showed."""
    monkeypatch.setattr(tasks, "_hardware", Hardware("cpu", 2))
    size, own = tasks.prepare_worker()
    queue = get_settings().queue
    assert size == f"{queue}-2dev"
    assert own.startswith(f"{queue}-node-")
    assert "gpu" not in size


def _privilege_warnings(accept_content: list[str]) -> list[str]:
    """What Celery's start-up check of a worker run as root warns, after tuneq's own setup."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tasks.ignore_root_warning_for_json()
        check_privileges(accept_content)
    return [str(w.message) for w in seen if issubclass(w.category, SecurityWarning)]


def test_celerys_superuser_warning_is_not_printed_for_a_worker_that_accepts_json_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight lines at every `tuneq worker` (and `tuneq dev`) start as root; where the worker
    would accept pickle, it stays (with C_FORCE_ROOT, Celery's setting for root and pickle)."""
    for name in ("getuid", "geteuid"):
        monkeypatch.setattr(os, name, lambda: 0)
    assert tasks.celery_app.conf.accept_content == ["json"]
    assert _privilege_warnings(["json"]) == []
    monkeypatch.setenv("C_FORCE_ROOT", "1")
    monkeypatch.setattr(tasks.celery_app.conf, "accept_content", ["json", "pickle"])
    assert any("superuser privileges" in w for w in _privilege_warnings(["json", "pickle"]))
