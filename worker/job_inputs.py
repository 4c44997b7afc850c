"""A job's datasets on this host: remote ones downloaded (cached by content) and checked,
uploaded files (``file-...``, ``POST /v1/files``) copied from the artifact store.

The worker fetches before it launches any rank, so the ranks never touch the network and a
bad remote dataset fails the job in seconds (``invalid_input``), not after DeepSpeed starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.data.preference import read_preference_records
from shared.data.records import DatasetError, SftFormat, read_records
from shared.data.remote import DatasetSourceError, dataset_file, local_path, parse_dataset_uri, shown_uri
from shared.data.uploaded_files import is_file_id
from shared.jobs.spec import TrainingMethod
from shared.settings import Settings

logger = logging.getLogger(__name__)

PROGRESS_EVERY_SECONDS = 2.0


class InputProblem(ValueError):
    """A dataset the job names cannot be used; ``str()`` is for the user."""


@dataclass(frozen=True)
class DownloadProgress:
    field: str  # "dataset" or "validation_dataset"
    uri: str  # as shown to users: no credentials, no query
    bytes_done: int
    bytes_total: int | None
    finished: bool


def local_dataset(
    field: str,
    value: str,
    *,
    dataset_format: SftFormat | None,
    settings: Settings,
    report: Callable[[DownloadProgress], None],
    method: TrainingMethod = "sft",
) -> str:
    """The local path of a job's dataset: itself when local, else the cached download, its
    records checked for the job's ``method`` (a DPO job's as preference records).

    ``report`` is called every few seconds while downloading (and may raise to abort: the
    worker renews the job's lease there and stops on a cancel).
    """
    if is_file_id(value):  # an uploaded file: copied from the artifact store, checked at upload
        try:
            return str(dataset_file(value, settings=settings))
        except DatasetSourceError as e:
            raise InputProblem(f"{field}: {e}") from None
    try:
        remote = parse_dataset_uri(value, settings)
    except DatasetSourceError as e:
        raise InputProblem(f"{field}: {e}") from None
    if remote is None:
        return str(local_path(value))
    shown = shown_uri(remote.uri)
    last = 0.0

    def on_progress(done: int, total: int | None) -> None:
        nonlocal last
        if time.monotonic() - last >= PROGRESS_EVERY_SECONDS:
            last = time.monotonic()
            report(DownloadProgress(field, shown, done, total, finished=False))

    logger.info("fetching %s %s", field, shown)
    try:
        path = dataset_file(value, settings=settings, on_progress=on_progress)
    except DatasetSourceError as e:
        raise InputProblem(f"{field}: {e}") from None
    size = path.stat().st_size
    report(DownloadProgress(field, shown, size, size, finished=True))
    # The records are checked here, as the API checks local files at submit.
    try:
        if method == "dpo":
            read_preference_records(path, max_line_bytes=settings.max_line_bytes)
        else:
            read_records(path, dataset_format=dataset_format, max_line_bytes=settings.max_line_bytes)
    except DatasetError as e:
        raise InputProblem(f"{field} '{shown}': {e}") from None
    return str(path)
