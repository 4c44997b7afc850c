"""A job's status and the class of its failure: the state machine's vocabulary, in one place.

The API, the worker, the ranks and the clients all speak it; ``shared.db.models`` stores it.
It imports nothing but the standard library, so the training processes and ``tuneq``'s client
commands do not load the database layer (SQLAlchemy, SQLModel) to name a status or an error.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    cancelling = "cancelling"  # cancel asked while running; the worker is stopping the ranks
    pausing = "pausing"  # pause asked while running; the ranks checkpoint at their next step and exit
    paused = "paused"  # stopped with its checkpoints, holding no worker, until resumed (not terminal)
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


# The statuses a job never leaves: the one definition the API, the worker and the clients use.
TERMINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


class ErrorCode(StrEnum):
    """Failure classes on a job's error. Users act on the message; code tells who must act."""

    invalid_input = "invalid_input"  # the job's data or config is wrong: fix the job
    unsupported_hardware = "unsupported_hardware"  # the job asks for what this worker cannot give
    training_error = "training_error"  # the training processes crashed
    worker_lost = "worker_lost"  # the worker stopped or died while the job ran (retried)
    host_error = "host_error"  # the host failed the attempt: out of memory, disk full (retried)
    timeout = "timeout"  # training.max_duration_seconds ran out
    cancelled = "cancelled"  # a user cancelled the job
    internal_error = "internal_error"  # tuneq itself failed
    artifact_store_unavailable = "artifact_store_unavailable"  # the store stayed unreachable: retry the upload
    artifact_integrity = "artifact_integrity"  # a file in the store is not the one that was published
