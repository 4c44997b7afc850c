"""A worker stopped gracefully while it runs a job, as a deploy stops it: on real processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from cli.samples import build_tiny_model, seed_config, write_text_dataset
from worker.tasks import WORKER_STOP_DEADLINE_SECONDS

from .harness import Tuneq, job_body, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.spread]


@pytest.mark.parametrize("signalled", ["main process", "process group"])
def test_a_worker_stopped_mid_job_hands_it_back_and_logs_no_error(tmp_path: Path, signalled: str) -> None:
    """SIGTERM to the worker's main process (as `docker stop` or Kubernetes sends it) or to its
    whole process group (systemd's default): the pool process stops the ranks, hands the job
    back and its task ends, and Celery stops it with the worker. The runner used to end that
    task with SystemExit(0), which Celery takes for the pool process dying under its task: the
    worker logged `ERROR ... WorkerLostError('Worker exited prematurely: exitcode 0.')` and a
    traceback on every such stop."""
    home = tmp_path / "home"
    build_tiny_model(home / "data" / "tiny-gpt-neo")
    write_text_dataset(home / "data" / "varied.jsonl", records=96)
    service = Tuneq(home=home, split=True).start()
    try:
        job = service.submit(
            job_body(
                home,
                "varied.jsonl",
                deepspeed_config=seed_config(fp16=False),
                training={"epochs": 10_000, "max_steps": 100_000, "max_seq_length": 64},
            )
        )
        wait_until(lambda: service.job(job["id"])["step"] >= 2, timeout=300, what="the job trained", tuneq=service)
        worker = service.processes[1]
        stopped_at = service.log.stat().st_size
        if signalled == "main process":
            worker.send_signal(signal.SIGTERM)
        else:
            os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=WORKER_STOP_DEADLINE_SECONDS + 30)
        with service.log.open("rb") as log:
            log.seek(stopped_at)
            stop_log = log.read().decode(errors="replace")
        assert "handing the job back" in stop_log, stop_log
        for failure in (" ERROR", "ERROR/", "WorkerLostError", "Traceback", "did not stop within"):
            assert failure not in stop_log, stop_log
        assert worker.returncode == 0, stop_log
        deadline = time.monotonic() + 30
        while (found := service.job(job["id"]))["status"] != "queued" and time.monotonic() < deadline:
            time.sleep(0.3)
        assert found["status"] == "queued" and found["error"] is None, found
    finally:
        service.stop()
