"""Short-lived links to a job's artifacts, for downloads that cannot carry the API key.

A browser following a link (or ``wget``) sends no ``Authorization`` header, so the dashboard,
with keys on, would otherwise have to fetch a file into memory to save it: a model of several
GB. ``POST /jobs/{id}/downloads`` makes a link whose random token is its key, valid for
``LINK_SECONDS`` and for one file; ``GET /downloads/{token}`` serves the file as the artifact
route does (Range, If-Range, a presigned redirect). Only the token's SHA-256 is stored, as for
API keys. Expired rows are removed as new links are made.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from datetime import datetime, timedelta

from sqlmodel import Session, col, delete

from shared.db.artifacts import get_artifact
from shared.db.models import Artifact, DownloadLink, as_utc, utcnow

# Long enough to click, short enough that a link copied out of the browser soon stops working.
LINK_SECONDS = 600
TOKEN_PREFIX = "dl_"


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_link(*, session: Session, job_id: uuid.UUID, path: str, owner: str) -> tuple[str, datetime]:
    """A new link's token for the job's file ``path`` (which must exist), and when it expires."""
    now = utcnow()
    session.execute(delete(DownloadLink).where(col(DownloadLink.expires_at) < now))
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    expires_at = now + timedelta(seconds=LINK_SECONDS)
    session.add(DownloadLink(token_hash=_hash(token), job_id=job_id, path=path, owner=owner, expires_at=expires_at))
    session.commit()
    return token, expires_at


def artifact_of_link(*, session: Session, token: str) -> Artifact | None:
    """The file a link names, or None for an unknown or expired link."""
    link = session.get(DownloadLink, _hash(token)) if token.startswith(TOKEN_PREFIX) else None
    if link is None:
        return None
    if as_utc(link.expires_at) <= utcnow():
        return None
    return get_artifact(session=session, job_id=link.job_id, path=link.path)
