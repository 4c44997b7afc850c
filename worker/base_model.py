"""The model a job starts from when its ``model`` names another job's output (``jobs.model_source``,
``shared.jobs.model_source``), made a local Hugging Face directory that the ranks load as they
load any model directory, tokenizer and chat template included.

- The named job's exported model is fetched from the artifact store into that job's run directory
  on this host (a cache), every file checked against the SHA-256 SQL recorded when it was
  published, as a ``resume_from`` checkpoint is (``worker.checkpoint_fetch``).
- A LoRA job's adapter (a job that did not also export its merged model) is fetched the same way
  and merged into that job's own base; a DeepSpeed checkpoint is fetched and its weights put into
  that job's model (``worker.rank.base_weights``, in a process of its own: it needs torch). What
  that writes is kept in ``$TUNEQ_HOME/cache/base-models/<job id>/``, for every later job on
  this host that names the same output.

That job's own base may itself be another job's output: it is made local first, the same way.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.artifacts.store import ArtifactStore
from shared.db.engine import session_scope
from shared.db.models import ArtifactKind, Job
from shared.jobs.model_source import ModelSource
from shared.jobs.run_layout import RunLayout
from shared.jobs.spec import LoraOptions, TrainingOptions
from shared.settings import Settings
from worker.checkpoint_fetch import fetch_checkpoint, fetch_export
from worker.job_inputs import InputProblem
from worker.start_from import CONVERTED_MARKER, run_conversion

logger = logging.getLogger(__name__)

BASE_WEIGHTS_MODULE = "worker.rank.base_weights"


@dataclass(frozen=True)
class NamedJob:
    """What making a job's output local needs of that job's row."""

    model: str
    revision: str | None
    model_source: ModelSource | None
    lora: LoraOptions | None


def _named_job(job_id: uuid.UUID) -> NamedJob:
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job is None:
            raise InputProblem(f"model: job {job_id}, whose output this job continues from, no longer exists")
        return NamedJob(
            model=job.model,
            revision=job.revision,
            model_source=ModelSource.model_validate(job.model_source) if job.model_source else None,
            lora=TrainingOptions.model_validate(job.training).lora,
        )


@dataclass(frozen=True)
class BaseModelMaker:
    """Makes named models local on this host: ``keep_alive`` is called while fetching and
    converting (it keeps the job's lease, and may raise to end the attempt); conversions append
    their output to ``log`` (the job's training log)."""

    settings: Settings
    store: ArtifactStore
    keep_alive: Callable[[], None]
    log: Path

    def local_model(self, source: ModelSource) -> Path:
        """The directory of the model ``source`` names, on this host."""
        layout = RunLayout.for_job(self.settings, source.job_id)
        if source.kind == "model":
            return self._export(source, layout, ArtifactKind.model)
        target = self.settings.cache_dir / "base-models" / str(source.job_id) / f"{source.kind}-step-{source.step}"
        if (target / CONVERTED_MARKER).is_file():
            return target
        named = _named_job(source.job_id)
        base, revision = self.base_of(named)
        staging = target.with_name(f"{target.name}.{os.getpid()}.partial")
        command = [sys.executable, "-m", BASE_WEIGHTS_MODULE, "--base", base, "--out", str(staging)]
        command += ["--revision", revision] if revision else []
        if source.kind == "adapter":
            command += ["--adapter", str(self._export(source, layout, ArtifactKind.adapter))]
            what = f"merging the LoRA adapter of job {source.job_id} into its base model {base}"
        else:
            checkpoint = fetch_checkpoint(
                store=self.store,
                job_id=source.job_id,
                layout=layout,
                step=source.step,
                keep_alive=self.keep_alive,
                deadline_seconds=self.settings.artifact_upload_deadline_seconds,
            )
            command += ["--checkpoint", str(checkpoint)]
            command += ["--lora", named.lora.model_dump_json()] if named.lora else []
            what = f"making the model of job {source.job_id}'s checkpoint at step {source.step}"
        logger.info("%s into %s", what, target)
        run_conversion(command, staging=staging, target=target, log=self.log, keep_alive=self.keep_alive, what=what)
        return target

    def base_of(self, named: NamedJob) -> tuple[str, str | None]:
        """The base model a job trained on, as ``from_pretrained`` takes it: a local directory
        (made local here when it is another job's output) or a hub id, and its revision."""
        if named.model_source is None:
            return named.model, named.revision
        return str(self.local_model(named.model_source)), None

    def _export(self, source: ModelSource, layout: RunLayout, kind: ArtifactKind) -> Path:
        return fetch_export(
            store=self.store,
            job_id=source.job_id,
            layout=layout,
            kind=kind,
            step=source.step,
            keep_alive=self.keep_alive,
            deadline_seconds=self.settings.artifact_upload_deadline_seconds,
        )
