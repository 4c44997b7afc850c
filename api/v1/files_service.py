"""What the Files routes (``/v1/files``) do, as keyword-only functions over a session. No HTTP in here.

An upload is copied from the request's spooled form to a temporary file a chunk at a time (held
to ``TUNEQ_MAX_UPLOAD_BYTES`` as it is read), checked record by record as OpenAI's chat (or DPO)
fine-tuning format, put in the artifact store under ``files/<id>``, and only then given its SQL
row: a file that fails anywhere leaves neither. Every read is scoped by owner, and another
owner's file is not found, exactly like a missing one.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Literal

from sqlmodel import Session, col, select

from api.artifact_download import artifact_store, read_range
from api.v1.pages import past_cursor
from shared.artifacts.store import file_key
from shared.data.records import DatasetError
from shared.data.uploaded_files import RESULTS_PURPOSE, UPLOAD_PURPOSE, check_uploaded_file, is_file_id, new_file_id
from shared.db.models import File, FileListPublic, FilePublic
from shared.json_values import text_problem
from shared.settings import Settings

logger = logging.getLogger(__name__)

# The purposes tuneq keeps files for: OpenAI's others (assistants, batch, vision, ...) serve
# products tuneq does not have.
FILE_PURPOSES = (UPLOAD_PURPOSE,)
# What a list may be filtered by: the uploads, and the results files the jobs made.
LISTED_PURPOSES = (UPLOAD_PURPOSE, RESULTS_PURPOSE)
MAX_FILENAME_CHARS = 255  # File.filename's column
COPY_CHUNK_BYTES = 1024 * 1024
MAX_LIST_LIMIT = 10_000  # OpenAI's bound (and default) for one page of files

Order = Literal["asc", "desc"]


class FileRequestError(Exception):
    """The caller's request cannot be served; ``param`` names the parameter at fault."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class FileTooLargeError(FileRequestError):
    """The uploaded file is over ``TUNEQ_MAX_UPLOAD_BYTES``."""


def _filename_problem(filename: str | None) -> str | None:
    if not filename:
        return "the file has no name: send it as a file part with a filename (the SDK does: open(path, 'rb'))"
    if len(filename) > MAX_FILENAME_CHARS:
        return f"the file's name is {len(filename)} characters long: give one of at most {MAX_FILENAME_CHARS}"
    if (problem := text_problem(filename)) is not None:
        return f"the file's name {problem}"
    return None


def _spool(source: BinaryIO, target: Path, *, limit: int) -> int:
    """Copy ``source`` to ``target`` a chunk at a time, refusing it the moment it passes ``limit``
    bytes (before that chunk is written): its size."""
    source.seek(0)
    size = 0
    with target.open("wb") as out:
        while chunk := source.read(COPY_CHUNK_BYTES):
            size += len(chunk)
            if size > limit:
                raise FileTooLargeError(
                    f"the file is larger than {limit} bytes, the most tuneq takes (TUNEQ_MAX_UPLOAD_BYTES): "
                    "split the data into smaller files",
                    param="file",
                )
            out.write(chunk)
    return size


def create_file(
    *, session: Session, settings: Settings, owner: str, upload: BinaryIO, filename: str | None, purpose: str
) -> File:
    """Check, store and record ``owner``'s upload. Raises FileRequestError (FileTooLargeError)
    for a file that cannot be kept; nothing of it is left behind then."""
    if purpose not in FILE_PURPOSES:
        raise FileRequestError(
            f"purpose {purpose!r} is not one tuneq keeps files for: use 'fine-tune' (files to fine-tune on)",
            param="purpose",
        )
    if (problem := _filename_problem(filename)) is not None:
        raise FileRequestError(problem, param="file")
    assert filename is not None
    file_id = new_file_id()
    store = artifact_store(settings)
    with tempfile.TemporaryDirectory(prefix="tuneq-upload-") as scratch:
        path = Path(scratch) / "upload.jsonl"
        _spool(upload, path, limit=settings.max_upload_bytes)
        try:
            checked = check_uploaded_file(path, max_line_bytes=settings.max_line_bytes)
        except DatasetError as e:
            raise FileRequestError(f"{filename}: {e}", param="file") from None
        stored = store.put_file(path, file_key(file_id))
    row = File(
        id=file_id,
        owner=owner,
        filename=filename,
        purpose=purpose,
        bytes=stored.size,
        sha256=stored.sha256,
        records=checked.records,
        dataset_format=checked.dataset_format,
    )
    session.add(row)
    try:
        session.commit()
    except BaseException:
        # No row, so no stored bytes either (they would be an upload that never finished).
        session.rollback()
        store.delete([stored.key])
        raise
    logger.info("file %s (%s, %d bytes) uploaded by %s", file_id, filename, stored.size, owner)
    return row


def get_file(*, session: Session, file_id: str, owner: str) -> File | None:
    """``owner``'s file, or None: another owner's file is not found, exactly like a missing one.
    Every lookup of a file on a caller's behalf goes through here."""
    if not is_file_id(file_id):  # not found without a query
        return None
    file = session.get(File, file_id)
    return file if file is not None and file.owner == owner else None


def not_training_data(file: File) -> str | None:
    """Why ``file`` is not data to train on (a job's results file), or None: the one refusal of
    both doors, /v1's ``training_file`` and a native job's ``dataset``."""
    if file.purpose == UPLOAD_PURPOSE:
        return None
    return (
        f"file {file.id} is a job's results (purpose {file.purpose!r}), not data to train on: upload the data "
        "with POST /v1/files (purpose 'fine-tune') and give its id"
    )


def list_files(
    *, session: Session, owner: str, purpose: str | None, limit: int, order: Order, after: str | None
) -> FileListPublic:
    """One page of ``owner``'s files by creation time (ties by id), newest first for ``desc``;
    ``after``: the id the previous page ended with."""
    newest_first = order == "desc"
    created, ident = col(File.created_at), col(File.id)
    query = select(File).where(File.owner == owner)
    if purpose is not None:
        if purpose not in LISTED_PURPOSES:
            return FileListPublic(data=[], first_id="", last_id="", has_more=False)
        query = query.where(File.purpose == purpose)
    if after is not None:
        cursor = get_file(session=session, file_id=after, owner=owner)
        if cursor is None:
            raise FileRequestError(
                f"after: no file {after!r} of yours to continue from: pass the last_id of the page before",
                param="after",
            )
        query = query.where(
            past_cursor(
                created, ident, cursor_created=cursor.created_at, cursor_id=cursor.id, newest_first=newest_first
            )
        )
    ordering = (created.desc(), ident.desc()) if newest_first else (created.asc(), ident.asc())
    rows = session.exec(query.order_by(*ordering).limit(limit + 1)).all()
    page = [FilePublic.from_file(r) for r in rows[:limit]]
    return FileListPublic(
        data=page,
        first_id=page[0].id if page else "",
        last_id=page[-1].id if page else "",
        has_more=len(rows) > limit,
    )


def read_file_content(*, settings: Settings, file: File) -> Iterator[bytes]:
    """The file's bytes from the store, a chunk at a time."""
    return read_range(artifact_store(settings), file_key(file.id), 0, file.bytes - 1)


def delete_file(*, session: Session, settings: Settings, file: File) -> None:
    """Delete the row, then the stored bytes: once the row is gone nothing serves them, so a
    store that fails here leaves only bytes no one can reach (logged), never a row without them."""
    session.delete(file)
    session.commit()
    try:
        artifact_store(settings).delete([file_key(file.id)])
    except Exception:
        logger.exception("file %s: its row is deleted, but its bytes stay in the store (unreachable)", file.id)
