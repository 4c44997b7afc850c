"""OpenAI's Files API at ``/v1/files``: thin routes over ``api.v1.files_service``.

What the SDK's ``client.files`` calls: ``create`` (multipart ``file`` + ``purpose``), ``list``,
``retrieve``, ``content`` and ``delete``, with OpenAI's object shapes and error envelope.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from sqlmodel import Session

from api.auth import OwnerDep
from api.deps import ReadSessionDep, SessionDep, SettingsDep
from api.errors import Responses
from api.v1 import files_service
from api.v1.errors import PREFIX, OpenAIHTTPException, error
from api.v1.pages import After
from shared.db.models import File as FileRow
from shared.db.models import FileDeletedPublic, FileListPublic, FilePublic

UPLOAD_PATH = f"{PREFIX}/files"

# Every route takes the owner (OwnerDep) itself, as the job routes do (api.routes.jobs). "4XX"
# declares OpenAI's envelope for every client error, which also keeps FastAPI from declaring the
# 422 it never answers here (its validation errors are 400s on /v1).
router = APIRouter(
    prefix=UPLOAD_PATH,
    tags=["files (OpenAI-compatible)"],
    responses={
        "4XX": error("In OpenAI's envelope: 400 a bad parameter or file, 401 no key or a bad one, 404 no such file")
    },
)

NOT_FOUND: Responses = {404: error("No such file (or one another owner uploaded)")}


def _not_found(file_id: str) -> OpenAIHTTPException:
    """The answer for a missing file, and for another owner's file alike (OpenAI's words)."""
    return OpenAIHTTPException(404, f"No such File object: {file_id}", param="id")


def _file_or_404(session: Session, file_id: str, owner: str) -> FileRow:
    file = files_service.get_file(session=session, file_id=file_id, owner=owner)
    if file is None:
        raise _not_found(file_id)
    return file


@router.post(
    "",
    response_model=FilePublic,
    responses={
        400: error("The purpose is not 'fine-tune', or a record is not OpenAI's chat format (its line and field)"),
        413: error("The file is over TUNEQ_MAX_UPLOAD_BYTES"),
    },
)
def create_file(
    session: SessionDep,
    settings: SettingsDep,
    owner: OwnerDep,
    file: Annotated[UploadFile, File(description="JSON Lines, one OpenAI chat fine-tuning record per line")],
    purpose: Annotated[str, Form(description="'fine-tune', the one purpose tuneq keeps files for")],
) -> FilePublic:
    """Upload a fine-tuning file: every record is checked before the file is kept."""
    try:
        row = files_service.create_file(
            session=session, settings=settings, owner=owner, upload=file.file, filename=file.filename, purpose=purpose
        )
    except files_service.FileTooLargeError as e:
        raise OpenAIHTTPException(413, str(e), param=e.param) from None
    except files_service.FileRequestError as e:
        raise OpenAIHTTPException(400, str(e), param=e.param) from None
    return FilePublic.from_file(row)


@router.get("", response_model=FileListPublic, responses={400: error("`after` names no file of the caller's")})
def list_files(
    session: ReadSessionDep,
    owner: OwnerDep,
    purpose: Annotated[str | None, Query(description="Only files with this purpose")] = None,
    limit: Annotated[int, Query(ge=1, le=files_service.MAX_LIST_LIMIT)] = files_service.MAX_LIST_LIMIT,
    order: Annotated[files_service.Order, Query(description="By created_at")] = "desc",
    after: After = None,
) -> FileListPublic:
    try:
        return files_service.list_files(
            session=session, owner=owner, purpose=purpose, limit=limit, order=order, after=after
        )
    except files_service.FileRequestError as e:
        raise OpenAIHTTPException(400, str(e), param=e.param) from None


@router.get("/{file_id}", response_model=FilePublic, responses=NOT_FOUND)
def retrieve_file(file_id: str, session: ReadSessionDep, owner: OwnerDep) -> FilePublic:
    return FilePublic.from_file(_file_or_404(session, file_id, owner))


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "The file as uploaded"}, **NOT_FOUND},
)
def retrieve_file_content(
    file_id: str, session: ReadSessionDep, settings: SettingsDep, owner: OwnerDep
) -> StreamingResponse:
    """The file's bytes, exactly as uploaded, streamed from the artifact store."""
    file = _file_or_404(session, file_id, owner)
    headers = {
        "Content-Length": str(file.bytes),
        # RFC 6266's encoded form: a client's file name may hold any character.
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(file.filename, safe='')}",
    }
    return StreamingResponse(
        files_service.read_file_content(settings=settings, file=file),
        media_type="application/octet-stream",
        headers=headers,
    )


@router.delete("/{file_id}", response_model=FileDeletedPublic, responses=NOT_FOUND)
def delete_file(file_id: str, session: SessionDep, settings: SettingsDep, owner: OwnerDep) -> FileDeletedPublic:
    """Delete the file: its row and its bytes in the store."""
    file = _file_or_404(session, file_id, owner)
    files_service.delete_file(session=session, settings=settings, file=file)
    return FileDeletedPublic(id=file_id, deleted=True)
