"""Where a job with ``resume_from`` starts: another job's DeepSpeed checkpoint, converted to
DeepSpeed's universal format when it was saved on another number of ranks.

ZeRO shards optimizer state by rank, so a checkpoint of 2 ranks does not load into 1 or 4.
DeepSpeed's ``ds_to_universal`` rewrites it as one file per parameter, which any number of
ranks loads (``checkpoint.load_universal``). The conversion runs in its own process group
(it needs torch; the worker does not import it) while the worker keeps the lease.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from shared.artifacts.store import ArtifactStore
from shared.jobs.run_layout import CheckpointManifest, RunLayout, tail_lines
from shared.jobs.spec import ResumePoint
from shared.settings import Settings
from worker.checkpoint_fetch import fetch_checkpoint
from worker.job_inputs import InputProblem

logger = logging.getLogger(__name__)

CONVERTED_MARKER = "tuneq-universal-complete"
POLL_SECONDS = 0.5


class ConversionFailed(RuntimeError):
    """A conversion (``ds_to_universal``, ``worker.rank.base_weights``) exited with an error; the
    message names the log."""


def start_point(
    resume_from: dict[str, object],
    *,
    num_gpus: int,
    layout: RunLayout,
    settings: Settings,
    store: ArtifactStore,
    keep_alive: Callable[[], None],
) -> ResumePoint:
    """The checkpoint to load, fetched from the artifact store into the other job's run
    directory on this host (a cache) and checked; ``keep_alive`` is called while converting
    (it may raise)."""
    source_id = uuid.UUID(str(resume_from["job_id"]))
    source = RunLayout.for_job(settings, source_id)
    step = int(str(resume_from["step"]))
    tag = source.checkpoint_tag(step)
    fetched = fetch_checkpoint(
        store=store,
        job_id=source_id,
        layout=source,
        step=step,
        keep_alive=keep_alive,
        deadline_seconds=settings.artifact_upload_deadline_seconds,
    )
    manifest = CheckpointManifest.read(fetched)
    if manifest is None:
        raise InputProblem(f"resume_from: the checkpoint of job {source_id} at step {step} has no manifest")
    if manifest.world_size == num_gpus:
        return ResumePoint(checkpoints_dir=str(source.checkpoints_dir), tag=tag, step=step)
    converted = layout.root / "start-from"
    if not (converted / tag / CONVERTED_MARKER).is_file():
        logger.info(
            "job %s: converting %s (%d ranks) to the universal format for %d ranks",
            layout.root.name,
            tag,
            manifest.world_size,
            num_gpus,
        )
        convert_to_universal(source.checkpoints_dir / tag, converted / tag, log=layout.log, keep_alive=keep_alive)
    return ResumePoint(checkpoints_dir=str(converted), tag=tag, step=step, universal=True)


def convert_to_universal(source: Path, target: Path, *, log: Path, keep_alive: Callable[[], None]) -> None:
    staging = target.with_name(target.name + ".partial")
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(source),
        "--output_folder",
        str(staging),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
        # Checkpoints of a plain engine (no Megatron tensor/pipeline parallelism) lack the
        # universal_checkpoint_info a Megatron client writes; the converter then adds it.
        "--inject_missing_state",
    ]
    run_conversion(
        command,
        staging=staging,
        target=target,
        log=log,
        keep_alive=keep_alive,
        what="converting the resume_from checkpoint to DeepSpeed's universal format",
    )


def run_conversion(
    command: list[str], *, staging: Path, target: Path, log: Path, keep_alive: Callable[[], None], what: str
) -> None:
    """Run ``command``, which writes ``staging``, in its own process group, its output appended
    to ``log``, calling ``keep_alive`` meanwhile (it may raise: the process is then killed); once
    it succeeds, ``staging`` is marked complete and takes ``target``'s name. Raises
    ConversionFailed, naming ``what`` failed and the log's last error line."""
    shutil.rmtree(staging, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    try:
        while process.poll() is None:
            keep_alive()
            time.sleep(POLL_SECONDS)
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if process.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        lines = [ln for ln in tail_lines(log, 100) if "Error" in ln or "error" in ln]
        reason = lines[-1].strip() if lines else f"exit status {process.returncode}"
        raise ConversionFailed(f"{what} failed: {reason} (full log: {log})")
    (staging / CONVERTED_MARKER).write_text("ok\n", encoding="utf-8")
    if (target / CONVERTED_MARKER).is_file():  # another process made the same meanwhile
        shutil.rmtree(staging, ignore_errors=True)
        return
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
