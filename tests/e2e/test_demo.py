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


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo") / "home"


@pytest.fixture(scope="module")
def demo(demo_home: Path) -> subprocess.CompletedProcess[str]:
    """One `tuneq demo` run, as `make demo` runs it (its output not a terminal, as in CI or a pipe)."""
    env = {**os.environ, "TUNEQ_HOME": str(demo_home)}
    for var in ("TUNEQ_DATABASE_URL", "TUNEQ_BROKER_URL", "TUNEQ_ALLOWED_ROOTS", "TUNEQ_QUEUE"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "demo"], env=env, capture_output=True, text=True, timeout=900
    )


def test_demo_runs_the_seed_job_and_stops_the_service(demo: subprocess.CompletedProcess[str], demo_home: Path) -> None:
    result = demo
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "loss curve:" in result.stdout and "step   40" in result.stdout
    # What a user wants to see, and nothing of the services: their logs go to a file it names,
    # and a clean stop logs no error there either.
    output = result.stdout + result.stderr
    for noise in ("HTTP Request:", "celery@", "-------------- ", "ERROR"):
        assert noise not in output, output[-3000:]
    assert "job " in result.stdout and " succeeded at step 40/40" in result.stdout
    service_log = demo_home / "demo-services.log"
    assert str(service_log) in result.stdout
    logged = service_log.read_text(errors="replace")
    assert "worker" in logged and "ERROR" not in logged, logged[-3000:]
    # Nor the warnings of before: Celery's for root, DeepSpeed's for a host without GPUs, and a
    # CPU host's size queue named as GPUs.
    for noise in ("superuser privileges", "Setting accelerator to CPU"):
        assert noise not in logged, logged[-3000:]
    assert re.search(r"^\s+\.> tuneq-\d+dev ", logged, re.M) and not re.search(r"tuneq-\d+gpu", logged), logged
    assert [p.pid for p in psutil.process_iter() if _home_of(p) == str(demo_home)] == []


def test_the_demos_last_line_is_a_command_that_runs_the_model(demo: subprocess.CompletedProcess[str]) -> None:
    """It used to end with `TUNEQ_URL=http://127.0.0.1:<port> tuneq download …`: `tuneq` was not
    on PATH (nothing activates .venv) and that service had stopped. The command printed runs as
    it is, from the directory the demo ran in."""
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    lines = demo.stdout.splitlines()
    assert lines[-1].startswith("try it: "), lines[-3:]
    command = lines[-1].removeprefix("try it: ")
    assert command.startswith(".venv/bin/python -c ") or not Path.cwd().joinpath(".venv").is_dir(), command
    tried = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300)
    assert tried.returncode == 0, tried.stderr[-3000:]
    assert tried.stdout.startswith("The cat"), tried.stdout
    model = re.search(r"^fine-tuned model: (/\S+) ", demo.stdout, re.M)
    assert model is not None and f'path = "{model.group(1)}"' in command


def test_the_demo_prints_its_own_lines_and_nothing_else(demo: subprocess.CompletedProcess[str]) -> None:
    """No blank lines (the tokenizer trainer's, where stdout is no terminal), no progress bars
    (transformers' "Writing model shards"), no DeepSpeed warning that it found no GPU, and the
    line of a checkpoint in step order: its event comes once its files are stored, which was
    after the lines of later steps ("step 35/40", then "checkpoint deepspeed at step 20")."""
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    output = demo.stdout + demo.stderr
    assert "\n\n" not in output and "\r" not in output, output[:3000]
    for noise in ("it/s]", "Writing model shards", "[WARNING]", "Setting accelerator"):
        assert noise not in output, output[:3000]
    followed = demo.stdout.split("submitted job", 1)[1].split("loss curve:", 1)[0].splitlines()
    steps = [int(line.split()[1].split("/")[0]) for line in followed if line.startswith("step ")]
    assert steps == sorted(steps) and steps[-1] == 40, followed
    at = next(i for i, line in enumerate(followed) if line.startswith("checkpoint deepspeed at step 20:"))
    assert followed[at - 1].startswith("step 20/40 "), followed


def _home_of(process: psutil.Process) -> str | None:
    try:
        return process.environ().get("TUNEQ_HOME")
    except (psutil.Error, OSError):
        return None
