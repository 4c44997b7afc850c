"""TUNEQ_LOG_FORMAT / TUNEQ_LOG_LEVEL: text for people, one JSON object per line for collectors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.logging_config import configure_logging
from shared.settings import Settings


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.mark.usefixtures("restore_root_logger")
def test_json_lines_carry_level_logger_message_and_extras(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(Settings(log_format="json", log_level="info"))
    logging.getLogger("worker.runner").info("job %s started", "abc", extra={"job_id": "abc"})
    logging.getLogger("worker.runner").debug("not at INFO")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["level"] == "INFO" and record["logger"] == "worker.runner"
    assert record["message"] == "job abc started" and record["job_id"] == "abc"
    assert "time" in record


@pytest.mark.usefixtures("restore_root_logger")
def test_text_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(Settings())
    logging.getLogger("api.main").warning("plain")
    assert capsys.readouterr().err.rstrip().endswith("WARNING api.main: plain")


def run_tuneq(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "migrate"],
        env={**os.environ, "TUNEQ_HOME": str(tmp_path), "TUNEQ_DATABASE_URL": "", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_server_command_logs_json_when_asked(tmp_path: Path) -> None:
    result = run_tuneq(tmp_path, TUNEQ_LOG_FORMAT="json")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines()]
    assert any(r["logger"] == "shared.db.engine" and "migrating" in r["message"] for r in records)


def test_a_bad_setting_names_the_variable_without_a_traceback(tmp_path: Path) -> None:
    result = run_tuneq(tmp_path, TUNEQ_LOG_FORMAT="yaml")
    assert result.returncode == 2
    assert "TUNEQ_LOG_FORMAT='yaml'" in result.stderr and "'text' or 'json'" in result.stderr
    assert "Traceback" not in result.stderr


def test_deepspeeds_guess_that_this_host_has_no_gpu_is_not_logged_and_its_other_warnings_are() -> None:
    """Every tuneq process that imports DeepSpeed on a host without GPUs (the API checking a
    config, the demo saving its model through transformers) printed `[WARNING] ... Setting
    accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.`"""
    probe = (
        "import logging; from shared.logging_config import configure_logging; from shared.settings import Settings; "
        "configure_logging(Settings()); import deepspeed; from deepspeed.accelerator import get_accelerator; "
        "get_accelerator(); logging.getLogger('DeepSpeed').warning('another warning')"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "Setting accelerator" not in output and "another warning" in output, output
