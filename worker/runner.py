"""Running one job: claim it, launch the ranks, ingest their events, record the outcome."""

from __future__ import annotations

import json
import logging
import signal
import time
import uuid
from types import FrameType

from shared.db import session_scope
from shared.deepspeed_config import wants_fp16
from shared.events import RankError
from shared.models import ErrorCode, JobStatus
from shared.settings import Settings
from shared.spec import TrainingOptions, TrainingSpec
from shared.storage import RunLayout, tail_lines, write_json_atomic
from shared.validation import FP16_NEEDS_CUDA
from worker.ingest import EventIngestor
from worker.launcher import HostHardware, launch_ranks, stop_ranks
from worker.lifecycle import claim_job, finish_job

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 10.0


class WorkerStopping(Exception):
    """The worker process was asked to stop while a job ran."""


def _raise_stopping(signum: int, _frame: FrameType | None) -> None:
    raise WorkerStopping(signal.Signals(signum).name)


def hardware_problem(*, num_gpus: int, deepspeed_config: dict[str, object], hardware: HostHardware) -> str | None:
    if wants_fp16(deepspeed_config) and hardware.accelerator != "cuda":
        return FP16_NEEDS_CUDA
    if num_gpus > hardware.device_count:
        unit = "GPUs" if hardware.accelerator == "cuda" else "CPU cores (this worker has no GPU)"
        have = hardware.device_count
        return f"num_gpus is {num_gpus} but this worker has {have} {unit}: ask for at most {have}"
    return None


def failure_from_ranks(layout: RunLayout) -> tuple[str, str]:
    """The first rank error by time, or else the last exception-looking line of the log."""
    errors = []
    for path in sorted(layout.errors_dir.glob("rank-*.json")):
        try:
            errors.append(RankError.model_validate_json(path.read_text(encoding="utf-8")))
        except ValueError:
            continue
    if errors:
        first = min(errors, key=lambda e: e.time)
        return first.code, first.message
    lines = tail_lines(layout.log, 200)
    meaningful = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    message = meaningful[-1].strip() if meaningful else "the training processes exited with an error"
    return ErrorCode.training_error, f"{message} (full log: {layout.log})"


def run_job(job_id: uuid.UUID, *, settings: Settings, hardware: HostHardware, worker_id: str) -> None:
    with session_scope() as session:
        job = claim_job(session=session, job_id=job_id, worker_id=worker_id)
        if job is None:
            logger.info("job %s is not queued any more; this delivery does nothing", job_id)
            return
        problem = hardware_problem(num_gpus=job.num_gpus, deepspeed_config=job.deepspeed_config, hardware=hardware)
        if problem:
            finish_job(
                session=session,
                job_id=job_id,
                status=JobStatus.failed,
                error_code=ErrorCode.unsupported_hardware,
                error_message=problem,
            )
            return
        layout = RunLayout.for_job(settings, job_id)
        layout.root.mkdir(parents=True, exist_ok=True)
        spec = TrainingSpec(
            job_id=job.id,
            model=job.model,
            dataset=job.dataset,
            deepspeed_config=job.deepspeed_config,
            num_gpus=job.num_gpus,
            training=TrainingOptions.model_validate(job.training),
            run_dir=str(layout.root),
        )
        write_json_atomic(layout.spec, json.loads(spec.model_dump_json()))

    logger.info("job %s: starting %d ranks on %s", job_id, spec.num_gpus, hardware.accelerator)
    ingestor = EventIngestor(path=layout.events, job_id=job_id)
    previous = signal.signal(signal.SIGTERM, _raise_stopping)
    process = None
    try:
        process = launch_ranks(
            spec_path=layout.spec, num_ranks=spec.num_gpus, hardware=hardware, log_path=layout.log, cwd=layout.root
        )
        with session_scope() as session:
            while process.poll() is None:
                ingestor.poll(session)
                time.sleep(POLL_SECONDS)
            ingestor.poll(session)
            if process.returncode == 0:
                finish_job(session=session, job_id=job_id, status=JobStatus.succeeded)
                logger.info("job %s succeeded", job_id)
            else:
                code, message = failure_from_ranks(layout)
                finish_job(
                    session=session, job_id=job_id, status=JobStatus.failed, error_code=code, error_message=message
                )
                logger.warning("job %s failed (exit %s): %s", job_id, process.returncode, message)
    except WorkerStopping:
        logger.warning("job %s: worker stopping, stopping its ranks", job_id)
        if process is not None:
            stop_ranks(process, grace_seconds=STOP_GRACE_SECONDS)
        with session_scope() as session:
            finish_job(
                session=session,
                job_id=job_id,
                status=JobStatus.failed,
                error_code=ErrorCode.worker_lost,
                error_message="the worker was stopped while this job ran; submit it again",
            )
        raise SystemExit(0) from None
    except Exception:
        logger.exception("job %s: the worker failed while running it", job_id)
        if process is not None:
            stop_ranks(process, grace_seconds=STOP_GRACE_SECONDS)
        with session_scope() as session:
            finish_job(
                session=session,
                job_id=job_id,
                status=JobStatus.failed,
                error_code=ErrorCode.internal_error,
                error_message="tuneq failed while running this job; the worker log has the details",
            )
    finally:
        signal.signal(signal.SIGTERM, previous)
