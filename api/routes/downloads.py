"""``GET /downloads/{token}``: a file through a short-lived link (``POST /jobs/{id}/downloads``,
``api.download_links``), with no key: the token is the link's key."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException
from fastapi import Path as PathParam
from fastapi.responses import Response, StreamingResponse

from api.artifact_download import FILE_RESPONSES, serve_artifact
from api.deps import ReadSessionDep, SettingsDep
from api.download_links import artifact_of_link
from api.errors import error

router = APIRouter(tags=["jobs"])


@router.get(
    "/downloads/{token}",
    response_class=StreamingResponse,
    responses={**FILE_RESPONSES, 404: error("The link is unknown or expired")},
)
def download_by_link(
    token: Annotated[str, PathParam(max_length=200)],
    session: ReadSessionDep,
    settings: SettingsDep,
    range: Annotated[str | None, Header(max_length=200)] = None,
    if_range: Annotated[str | None, Header(max_length=200)] = None,
) -> Response:
    """The file the link names, as ``GET /jobs/{id}/artifacts/{path}`` serves it."""
    artifact = artifact_of_link(session=session, token=token)
    if artifact is None:
        raise HTTPException(
            status_code=404,
            detail="this download link is unknown or expired (links last 10 minutes): make a new one with "
            "POST /jobs/{id}/downloads, or download with the API key",
        )
    return serve_artifact(artifact, settings=settings, range_header=range, if_range=if_range)
