"""`make demo` is `tuneq demo`: it must run the main job end to end and leave nothing behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_the_seed_job_and_stops_the_service(tmp_path: Path) -> None:
    env = {**os.environ, "TUNEQ_HOME": str(tmp_path / "home")}
    for var in ("TUNEQ_DATABASE_URL", "TUNEQ_BROKER_URL", "TUNEQ_ALLOWED_ROOTS"):
        env.pop(var, None)
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "demo"], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "loss curve:" in result.stdout and "step   40" in result.stdout
    # What a user wants to see, and nothing of the services: their logs go to a file it names,
    # and a clean stop logs no error there either.
    output = result.stdout + result.stderr
    for noise in ("HTTP Request:", "celery@", "-------------- ", "ERROR"):
        assert noise not in output, output[-3000:]
    assert "job " in result.stdout and " succeeded at step 40/40" in result.stdout
    service_log = Path(env["TUNEQ_HOME"]) / "demo-services.log"
    assert str(service_log) in result.stdout
    logged = service_log.read_text(errors="replace")
    assert "worker" in logged and "ERROR" not in logged, logged[-3000:]
    model = next(line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("fine-tuned model:"))
    assert re.search(
        r"^or download it: TUNEQ_URL=http://127\.0\.0\.1:\d+ tuneq download [0-9a-f-]{36} DEST$", result.stdout, re.M
    )
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(model, use_safetensors=True)
    assert [p.pid for p in psutil.process_iter() if _home_of(p) == env["TUNEQ_HOME"]] == []


def _home_of(process: psutil.Process) -> str | None:
    try:
        return process.environ().get("TUNEQ_HOME")
    except (psutil.Error, OSError):
        return None
