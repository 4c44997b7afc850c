"""A succeeded job's results file: its per-step metrics as CSV, kept like an uploaded file
(OpenAI's ``result_files``: ``client.files.content(id)`` reads it).

The worker writes it as the job succeeds, from the ``job_metrics`` rows it ingested: the bytes go
to the artifact store under ``files/<id>`` first, then the ``files`` row (purpose
``fine-tune-results``, the job's owner, ``job_id``), so a row always has its bytes.
"""

from __future__ import annotations

import csv
import logging
import tempfile
import uuid
from pathlib import Path

from sqlmodel import col, select

from shared.artifacts.store import ArtifactStore, ArtifactStoreError, file_key
from shared.data.uploaded_files import RESULTS_PURPOSE, new_file_id
from shared.db.engine import session_scope
from shared.db.models import TRL_METRIC_NAMES, File, Job, JobMetric

logger = logging.getLogger(__name__)

RESULTS_FILENAME = "step_metrics.csv"  # OpenAI's name for it
# OpenAI's columns first (train_accuracy and the mean token accuracies are not measured), then
# what tuneq measures besides.
COLUMNS = ("step", "train_loss", "valid_loss", "learning_rate", "grad_norm", "epoch", "tokens_per_second")
# A DPO job's measures follow, under TRL's names (rewards/chosen ...), when the job has them.
PREFERENCE_FIELDS = tuple(TRL_METRIC_NAMES)


def metric_rows(metrics: list[JobMetric]) -> tuple[tuple[str, ...], list[tuple[object, ...]]]:
    """The file's header and rows: OpenAI's columns, then DPO's where any step measured them."""
    preference = [f for f in PREFERENCE_FIELDS if any(getattr(m, f) is not None for m in metrics)]
    header = (*COLUMNS, *(TRL_METRIC_NAMES[f] for f in preference))
    columns = ("step", "loss", "eval_loss", "learning_rate", "grad_norm", "epoch", "tokens_per_second", *preference)
    rows = [tuple(getattr(m, f) for f in columns) for m in metrics]
    return header, rows


def publish_results_file(*, job_id: uuid.UUID, store: ArtifactStore) -> str | None:
    """Write, store and record the job's results file; its id. None when the job is gone or
    already has one (a redelivered outcome). Raises ArtifactStoreError when the bytes cannot be
    stored; the database's errors as they come (the caller retries those like any outcome)."""
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job is None or session.exec(select(File.id).where(File.job_id == job_id)).first() is not None:
            return None
        owner = job.owner
        metrics = session.exec(select(JobMetric).where(JobMetric.job_id == job_id).order_by(col(JobMetric.step))).all()
        header, rows = metric_rows(list(metrics))
    file_id = new_file_id()
    try:
        with tempfile.TemporaryDirectory(prefix="tuneq-results-") as scratch:
            path = Path(scratch) / RESULTS_FILENAME
            with path.open("w", newline="") as out:
                writer = csv.writer(out)
                writer.writerow(header)
                writer.writerows(["" if value is None else value for value in row] for row in rows)
            stored = store.put_file(path, file_key(file_id))
    except Exception as e:  # the store's errors (or a full scratch disk), not the database's
        raise ArtifactStoreError(f"{store}: {e}") from e
    with session_scope() as session:
        session.add(
            File(
                id=file_id,
                owner=owner,
                filename=RESULTS_FILENAME,
                purpose=RESULTS_PURPOSE,
                bytes=stored.size,
                sha256=stored.sha256,
                records=len(rows),
                job_id=job_id,
            )
        )
        session.commit()
    logger.info("job %s: results file %s (%d steps)", job_id, file_id, len(rows))
    return file_id
