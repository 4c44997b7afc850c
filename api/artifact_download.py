"""Serving one published file of a job: streamed from the artifact store with ``Range``
support (a broken download resumes), or, with ``TUNEQ_ARTIFACTS_PRESIGN`` on an S3 store, a
redirect to a short-lived presigned URL.

Only files SQL lists (``artifacts`` rows) are served, looked up by their exact path in the
job: a path that is not one of them is a 404, so no path ever reaches the store unchecked.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache

from fastapi import HTTPException, Response
from fastapi.responses import RedirectResponse, StreamingResponse

from api.errors import Responses, error
from shared.artifacts.store import ArtifactStore, job_key
from shared.db.models import Artifact
from shared.settings import Settings

CHUNK_BYTES = 1024 * 1024
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@lru_cache(maxsize=4)
def _store(uri: str, s3_endpoint_url: str) -> ArtifactStore:
    return ArtifactStore(uri, s3_endpoint_url=s3_endpoint_url)


# What a route that serves a stored file answers (GET /jobs/{id}/artifacts/{path}, GET /downloads/{token}).
FILE_RESPONSES: Responses = {
    200: {"content": {"application/octet-stream": {}}, "description": "The file"},
    206: {"content": {"application/octet-stream": {}}, "description": "The bytes the Range header asked for"},
    307: {"description": "A presigned URL of the store (TUNEQ_ARTIFACTS_PRESIGN)"},
    416: error("The Range is outside the file"),
}


def artifact_store(settings: Settings) -> ArtifactStore:
    """This API process's store (one S3 client for all requests)."""
    return _store(settings.artifacts_uri, settings.s3_endpoint_url)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive (first, last) byte a ``Range`` header asks for; None for the whole file
    (no header, or one this server answers in full, as several ranges). 416 when no byte of
    it is in the file."""
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None  # a unit or form we do not serve in part: the whole file, as RFC 9110 allows
    first, last = match.groups()
    if first == "" and last == "":
        return None
    if first == "":  # the last N bytes
        length = int(last)
        if length == 0 or size == 0:
            raise _unsatisfiable(size)
        return max(0, size - length), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or end < start:
        raise _unsatisfiable(size)
    return start, end


def _unsatisfiable(size: int) -> HTTPException:
    return HTTPException(
        status_code=416,
        detail=f"the range is outside the file ({size} bytes)",
        headers={"Content-Range": f"bytes */{size}"},
    )


def serve_artifact(
    artifact: Artifact, *, settings: Settings, range_header: str | None, if_range: str | None
) -> Response:
    store = artifact_store(settings)
    key = job_key(artifact.job_id, artifact.path)
    if settings.artifacts_presign and (url := store.presigned_url(key, seconds=settings.artifacts_presign_seconds)):
        return RedirectResponse(url, status_code=307)
    etag = f'"{artifact.sha256}"'
    wanted = byte_range(range_header, artifact.size)
    if wanted is not None and if_range is not None and if_range != etag:
        wanted = None  # the file changed since the client's partial copy: send all of it
    first, last = wanted if wanted is not None else (0, artifact.size - 1)
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "Content-Length": str(max(0, last - first + 1)),
        "Content-Disposition": f'attachment; filename="{artifact.path.rsplit("/", 1)[-1]}"',
    }
    if wanted is not None:
        headers["Content-Range"] = f"bytes {first}-{last}/{artifact.size}"
    return StreamingResponse(
        read_range(store, key, first, last),
        status_code=206 if wanted is not None else 200,
        media_type="application/octet-stream",
        headers=headers,
    )


def read_range(store: ArtifactStore, key: str, first: int, last: int) -> Iterator[bytes]:
    """Bytes first..last of ``key``, a chunk at a time (Starlette runs this in a thread)."""
    with store.open(key) as f:
        f.seek(first)
        left = last - first + 1
        while left > 0 and (chunk := f.read(min(CHUNK_BYTES, left))):
            left -= len(chunk)
            yield chunk
