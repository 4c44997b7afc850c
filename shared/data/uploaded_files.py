"""Files uploaded through the OpenAI-compatible ``POST /v1/files``, as datasets: their ids.

A job names one by its id (``file-...``) where it would name a dataset path or URI, on
``/v1/fine_tuning/jobs`` (``training_file``) and on ``POST /jobs`` (``dataset``) alike. The API
checks at submit that the id is one of the caller's files; the worker copies its bytes from the
artifact store (``files/<id>``), checked against the SHA-256 recorded at upload.

An upload holds what OpenAI's fine-tuning takes: chat records (``messages``, for a supervised
job) or DPO records (``preference``), told apart by the first record's fields and checked line
by line by the rules of ``shared.data.records`` and ``shared.data.preference``
(``check_uploaded_file``); the file's row keeps which, so a job is refused at submit when its
method cannot train on it.
"""

from __future__ import annotations

import logging
import re
import secrets
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.artifacts.store import ArtifactStore, file_key
from shared.data.preference import EXAMPLES as PREFERENCE_EXAMPLES
from shared.data.preference import openai_preference_problem
from shared.data.records import JSON_LINES, check_json_lines, check_openai_chat_file, first_known_record
from shared.db.engine import session_scope
from shared.db.models import File
from shared.settings import Settings

logger = logging.getLogger(__name__)

UPLOAD_PURPOSE = "fine-tune"  # what POST /v1/files takes
RESULTS_PURPOSE = "fine-tune-results"  # a succeeded job's metrics (OpenAI's result_files)
ID_ALPHABET = string.ascii_letters + string.digits
ID_CHARS = 24  # ~143 random bits, as long as OpenAI's own file ids
# Any id tuneq could have made; anything else is not a file id (and never reaches SQL, where a
# NUL in a string is an error on Postgres).
FILE_ID = re.compile(rf"file-[{ID_ALPHABET}]{{{ID_CHARS}}}")
# What an upload may hold (``File.dataset_format``): OpenAI's chat records, or its DPO records.
UploadFormat = Literal["messages", "preference"]


@dataclass(frozen=True)
class CheckedUpload:
    dataset_format: UploadFormat
    records: int


def check_uploaded_file(path: Path, *, max_line_bytes: int) -> CheckedUpload:
    """What an upload holds, every line of it checked: OpenAI's chat fine-tuning format or its
    DPO format, by the first record with either's fields (chat when none has). Raises
    DatasetError naming the first bad lines as OpenAI's API does (``line 7: messages[1].role
    must be ...``)."""
    first = first_known_record(path, max_line_bytes=max_line_bytes, kind=JSON_LINES)
    if first is not None and first[2] == "preference":
        count = check_json_lines(
            path, openai_preference_problem, example=PREFERENCE_EXAMPLES["openai"], max_line_bytes=max_line_bytes
        )
        return CheckedUpload("preference", count)
    return CheckedUpload("messages", check_openai_chat_file(path, max_line_bytes=max_line_bytes))


def new_file_id() -> str:
    return "file-" + "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_CHARS))


def is_file_id(value: str) -> bool:
    """Whether ``value`` names an uploaded file rather than a path or URI."""
    return FILE_ID.fullmatch(value) is not None


class UploadedFileGone(ValueError):
    """The file was deleted after a job named it. ``str()`` is for the user."""


def uploaded_file_path(file_id: str, *, settings: Settings) -> Path:
    """This host's copy of an uploaded file, made once (a file never changes, it can only be
    deleted) and checked against the SHA-256 recorded at upload before it takes its name.
    Raises UploadedFileGone, and ArtifactStoreError / ArtifactIntegrityError as the store answers."""
    with session_scope() as session:
        file = session.get(File, file_id)
    if file is None:
        raise UploadedFileGone(
            f"file {file_id} was deleted after the job was submitted: upload it again (POST /v1/files) "
            "and submit a new job with its id"
        )
    local = settings.cache_dir / "files" / file_id
    if not local.is_file():
        logger.info("copying file %s (%d bytes) from the artifact store", file_id, file.bytes)
        ArtifactStore.from_settings(settings).get_file(file_key(file_id), local, sha256=file.sha256)
    return local
